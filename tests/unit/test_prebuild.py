"""The background warm-start builder (tests.helpers.prebuild): what it plans, what a test waits for."""

import sys

from flash.app.config import load_config
from flash.app.data import build_task
from tests import golden
from tests.helpers import prebuild

GOLDEN, DEFAULT = prebuild.GOLDEN_TEST, prebuild.DEFAULT_TEST


def test_the_tests_the_builder_knows_exist_by_those_names():
    for nodeid in (GOLDEN, DEFAULT):
        path, name = nodeid.split("::")
        assert f"def {name}(" in (prebuild.ROOT / path).read_text(), (
            f"{nodeid} is not there: update tests.helpers.prebuild"
        )


def test_the_plan_holds_each_selected_tests_warm_start_once_in_test_order_and_only_beside_unit_tests():
    unit = ("tests/unit/test_x.py::test_a", {})
    selected = [
        unit,
        (f"{GOLDEN}[math]", {"recipe": "math"}),
        ("tests/integration/test_other.py::test_b[1]", {"recipe": "code"}),
        (f"{DEFAULT}[2-0]", {"ratio": 2, "seed": 0}),
        (f"{DEFAULT}[0-0]", {"ratio": 0, "seed": 0}),
        (f"{GOLDEN}[code]", {"recipe": "code"}),
    ]
    assert [e.name for e in prebuild.plan(selected)] == ["golden-math", "default-seed0", "golden-code"]
    assert prebuild.plan(selected[1:]) == []  # no unit tier: no idle core to fill
    assert prebuild.plan([unit]) == []
    math = prebuild.plan(selected)[0]
    assert (math.recipe, list(math.overrides)) == ("recipes/math.yaml", golden.overrides("math"))


def test_the_default_recipes_entry_names_the_warm_start_its_runs_at_both_ratios_use():
    from flash.train.sft import cache_key

    def key(overrides):
        cfg = load_config(str(prebuild.ROOT / prebuild.DEFAULT_RECIPE), overrides)
        return cache_key(cfg.model.tiny, cfg.sft, build_task(cfg))

    entry = prebuild.default_recipe_entry(1)
    built = key(list(entry.overrides))
    assert built == key(prebuild.default_recipe_overrides(2, 1)) == key(prebuild.default_recipe_overrides(0, 1))
    assert built != key(list(prebuild.default_recipe_entry(0).overrides))  # the seed names its own


def test_wait_returns_the_builders_outcome_or_not_prebuilt(tmp_path, monkeypatch):
    cache = str(tmp_path)
    monkeypatch.setattr(prebuild, "_builder", None)  # this session's own builder, if any, is not this one
    assert prebuild.wait(cache, "golden-math") == "not prebuilt"  # no builder started
    (tmp_path / prebuild.DONE_FILE).write_text("ok golden-math\nfailed golden-code: ValueError: no: such\n")
    assert prebuild.finished(cache) == {"golden-math": "ok", "golden-code": "failed: ValueError: no: such"}

    class Running:  # a builder that never finishes
        def poll(self):
            return None

    monkeypatch.setattr(prebuild, "_builder", Running())
    assert prebuild.wait(cache, "golden-math") == "ok"
    assert prebuild.wait(cache, "golden-code") == "failed: ValueError: no: such"
    assert prebuild.wait(cache, "default-seed0", limit_s=0.3) == "not prebuilt"  # past its limit


def test_the_builder_records_a_failure_by_name_and_goes_on(tmp_path):
    bad = prebuild.Entry("broken", "recipes/no_such_recipe.yaml", ())
    stutter = prebuild.Entry("stutter", "recipes/stutter.yaml", ("sft.steps=0", "sft.eval_after=false"))
    prebuild.build(str(tmp_path), [bad, stutter])
    done = prebuild.finished(str(tmp_path))
    assert done["stutter"] == "ok" and done["broken"].startswith("failed: ")
    assert list(done) == ["broken", "stutter"]
    assert len(list(tmp_path.glob("sft-stutter-*/flash_warm_start.json"))) == 1
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
