"""Every shipped CPU recipe's first three synchronous steps equal its committed golden values.

From a fixed seed, each recipe (shrunk: ``tests.golden.SHAPES``) gives the same loss, gradient
norm and mean reward per step (within rel 1e-5, abs 1e-6, the norm rel 1e-3: another CPU's BLAS may
reduce in another order, ``tests.golden.REL_OF``) and the same first sampled token ids (exactly: every role samples on one torch thread) as
``tests/golden/RECIPE.json``. A change that moves them is re-blessed by
``python -m tests.golden bless RECIPE``, which runs the recipe's learning test first. One Ray for
the module; warm starts in the session's cache, built during the unit tier (``tests.helpers.prebuild``).
"""

import pytest

from tests import golden
from tests.golden import bless
from tests.helpers import prebuild

RECIPES = sorted(golden.SHAPES)


@pytest.fixture(scope="module")
def measured_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("golden_runs")


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_reproduces_its_golden_numerics(recipe, ray_local, warm_cache, measured_dir):
    expected = golden.read_golden(recipe)
    prebuild.wait(warm_cache, prebuild.golden_entry(recipe).name)
    measured = golden.run_golden(recipe, measured_dir / recipe, warm_cache)
    moved = golden.differences(expected, measured)
    assert not moved, golden.failure_message(moved)
    # the pinned values are exactly what the run logged, and they say something: some step learned
    assert [s["step"] for s in measured["steps"]] == list(range(1, golden.STEPS + 1))
    assert len(measured["tokens"]) == golden.RESPONSES and all(measured["tokens"])
    assert any(s["grad_norm"] > 0 for s in expected["steps"]), f"{recipe}: no step with a gradient to pin"


def test_every_shipped_recipe_is_pinned_or_named_with_a_reason():
    shipped = {p.stem for p in (golden.ROOT / "recipes").glob("*.yaml")}
    assert shipped == set(golden.SHAPES) | set(golden.NOT_PINNED)
    assert not set(golden.SHAPES) & set(golden.NOT_PINNED)
    assert {p.stem for p in golden.GOLDEN_DIR.glob("*.json")} == set(golden.SHAPES)
    assert set(bless.LEARNING) <= set(golden.SHAPES)


def test_a_moved_value_names_the_recipe_step_quantity_old_new_and_the_bless_command():
    old = {
        "recipe": "math",
        "overrides": ["a=1"],
        "tokens": [[1, 2], [3]],
        "step0_response_tokens": 9,
        "steps": [{"step": 1, "loss": 0.5, "grad_norm": 2.0, "reward_mean": 0.25}],
    }
    within = {**old, "steps": [{"step": 1, "loss": 0.5 * (1 + 5e-6), "grad_norm": 2.0, "reward_mean": 0.25}]}
    assert golden.differences(old, within) == []
    new = {
        **old,
        "tokens": [[1, 2], [4]],
        "steps": [{"step": 1, "loss": 0.5001, "grad_norm": 2.0, "reward_mean": 0.25}],
    }
    message = golden.failure_message(golden.differences(old, new))
    assert "math: step 1 loss moved: 0.5 -> 0.5001" in message
    assert "math: step 0 first token ids moved: [[1, 2], [3]] -> [[1, 2], [4]]" in message
    assert "grad_norm" not in message and "python -m tests.golden bless math" in message
    assert golden.differences({**old, "overrides": ["a=2"]}, old)[0].quantity == "overrides"
    assert golden.differences(old, {**old, "step0_response_tokens": 10})[0].line() == (
        "math: step 0 response tokens sampled moved: 9 -> 10"
    )
    near_zero = {**old, "steps": [{"step": 1, "loss": 5e-8, "grad_norm": 2.0, "reward_mean": 0.25}]}
    assert golden.differences({**old, "steps": [{**old["steps"][0], "loss": 0.0}]}, near_zero) == []
    # a gradient norm keeps rel 1e-3 (another CPU's reduction order), a loss rel 1e-5
    norm = lambda g, loss=0.5: {**old, "steps": [{"step": 1, "loss": loss, "grad_norm": g, "reward_mean": 0.25}]}
    assert golden.differences(old, norm(2.0 * (1 + 5e-4))) == []
    assert [m.quantity for m in golden.differences(old, norm(2.0 * (1 + 2e-3)))] == ["grad_norm"]
    assert [m.quantity for m in golden.differences(old, norm(2.0, 0.5 * (1 + 5e-5)))] == ["loss"]
