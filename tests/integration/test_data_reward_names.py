"""A dataset row never names code (flash.data.rows.checked_reward_name, flash.data.task): a
``reward_key`` column may name a registered reward or one the recipe lists in ``data.rewards``;
anything else, an import path included, is a ``bad_reward_name`` row that is counted and never
imported, in a run's task, in ``flash data`` and in ``flash validate``."""

import json
import os
import sys
import uuid

import pytest

from flash.app.cli import main
from flash.app.config import load_config
from flash.app.data_preview import preview, recipe_warnings, scan
from flash.app.data import build_task
from flash.data.rows import BadRow
from flash.errors import ConfigError
from flash.guards import InputGuard
from flash.models import build_tokenizer
from flash.tasks import TaskItem
from flash.recipes.tasks import make_task

PLANTED = """import pathlib
pathlib.Path(__file__).with_suffix(".imported").write_text("imported")


def fn(item, response):
    pathlib.Path(__file__).with_suffix(".called").write_text(response)
    return float(response.strip() == item.answer)
"""


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A module on the import path that records being imported (``.imported``) and called
    (``.called``) beside itself; its name is fresh for each test."""
    name = f"planted_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(PLANTED)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name, tmp_path / f"{name}.imported", tmp_path / f"{name}.called"
    sys.modules.pop(name, None)


@pytest.fixture
def system_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(os, "system", lambda *a, **k: calls.append(a) or 0)
    return calls


def write_rows(path, kinds):
    rows = [{"q": f"say {i}.", "answer": f"#### {i}", "kind": kind} for i, kind in enumerate(kinds)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_row_naming_an_import_path_is_a_bad_reward_name_and_is_never_imported(tmp_path, planted, system_calls):
    name, imported, called = planted
    kinds = ["os:system", f"{name}:fn", name, "code", "builtins:eval", "x" * 10_000]
    task = make_task(
        "dataset",
        train=(write_rows(tmp_path / "d.jsonl", kinds),),
        prompt_key="q",
        reward_key="kind",
        holdout=0,
        shuffle=False,
    )
    reasons = []
    for i in range(len(kinds)):
        try:
            task.item(i)
            reasons.append("ok")
        except BadRow as exc:
            reasons.append(exc.reason)
            assert "\n" not in str(exc) and len(str(exc)) < 400 and "data.rewards" in str(exc)
    assert reasons == [
        "bad_reward_name",
        "bad_reward_name",
        "bad_reward_name",
        "ok",
        "bad_reward_name",
        "bad_reward_name",
    ]
    forged = TaskItem(0, "say 1.", "1", meta={"reward_fn": f"{name}:fn"})  # an item not made by task.item
    with pytest.raises(BadRow) as err:
        task.reward(forged, "1")
    assert err.value.reason == "bad_reward_name"
    assert name not in sys.modules and not imported.exists() and not called.exists() and system_calls == []


def test_listed_rewards_and_registered_names_score_their_rows(tmp_path, planted):
    name, imported, called = planted
    kinds = ["exact", f"{name}:fn", "math", "m", "code"]
    task = make_task(
        "dataset",
        train=(write_rows(tmp_path / "d.jsonl", kinds),),
        prompt_key="q",
        reward_key="kind",
        holdout=0,
        shuffle=False,
        rewards={"exact": f"{name}:fn", "m": "math"},
    )
    items = [task.item(i) for i in range(len(kinds))]
    assert not imported.exists()  # listed code is imported when it first scores, not before
    assert [task.reward(items[0], "#### 0"), task.reward(items[0], "#### 9")] == [1.0, 0.0]
    assert imported.exists() and called.read_text() == "#### 9"
    assert task.reward(items[1], "#### 1") == 1.0  # a listed import path, named as itself
    assert task.reward(items[2], "\\boxed{2}") == 1.0 and task.reward(items[3], "\\boxed{3}") == 1.0
    assert items[3].meta["reward_fn"] == "m"  # the row's own name travels to the reward
    with pytest.raises(ValueError, match="code reward: item 4 has no meta"):  # the built-in code reward
        task.reward(items[4], "no code here")
    (tmp_path / "b.jsonl").write_text(json.dumps({"q": "q", "answer": "no number", "kind": "m"}) + "\n")
    bad = make_task(
        "dataset",
        train=(str(tmp_path / "b.jsonl"),),
        prompt_key="q",
        reward_key="kind",
        holdout=0,
        rewards={"m": "math"},
    )
    with pytest.raises(BadRow) as err:
        bad.item(0)
    assert err.value.reason == "bad_answer"  # a name listed for math is checked as math


def test_bad_reward_names_are_counted_by_the_input_guard_and_flash_data(tmp_path, planted):
    name, imported, called = planted
    path = write_rows(tmp_path / "d.jsonl", ["code", f"{name}:fn", "code", "os:system"])
    task = make_task("dataset", train=(path,), prompt_key="q", reward_key="kind", holdout=0, shuffle=False)
    result = scan(task, build_tokenizer(), 0, 4, scorer=task.reward)
    assert result["dropped"] == {"bad_reward_name": 2} and len(result["kept"]) == 2
    guard = InputGuard(max_prompt_tokens=0, max_consecutive=8, warn=lambda _: None)
    for i in range(4):
        try:
            guard.take(i, task.item, lambda p: build_tokenizer().encode(p))
        except Exception:
            pass
    assert guard.metrics() == {"data/skipped_bad_reward_name": 2.0}
    overrides = [
        f"data.train=[{path}]",
        "data.prompt_key=q",
        "data.sft_key=answer",
        "data.reward_key=kind",
        "reward.fn={}",
        "data.holdout=0",
    ]
    cfg = load_config("recipes/math.yaml", overrides)
    lines = []
    assert preview(cfg, rows=4, out=lines.append)["dropped"] == {"bad_reward_name": 2}
    assert any("bad_reward_name" in line for line in lines)
    recipe_warnings(cfg, build_task(cfg), rows=4)  # flash validate's reference scoring
    assert name not in sys.modules and not imported.exists() and not called.exists()


def test_data_rewards_are_checked_at_validate_in_one_line(tmp_path, planted, capsys):
    name, imported, _ = planted
    path = write_rows(tmp_path / "d.jsonl", ["exact"])
    base = [f"data.train=[{path}]", "data.prompt_key=q", "data.sft_key=answer", "reward.fn={}"]
    cases = [
        (["data.reward_key=kind", "data.rewards={exact: nosuch_mod_x:fn}"], "data.rewards.exact: reward"),
        (["data.reward_key=kind", "data.rewards={exact: mth}"], "did you mean 'math'"),
        ([f"data.rewards={{exact: '{name}:fn'}}"], "set data.reward_key"),
        (["data.reward=nosuch_mod_x:fn"], "data.reward: reward"),
    ]
    for extra, words in cases:
        with pytest.raises(ConfigError, match=words) as err:
            load_config("recipes/math.yaml", base + extra)
        assert "\n" not in str(err.value)
    cfg = load_config("recipes/math.yaml", base + ["data.reward_key=kind", f"data.rewards={{exact: '{name}:fn'}}"])
    assert cfg.data.rewards == {"exact": f"{name}:fn"} and imported.exists()  # the recipe named it
    assert main(["validate", "recipes/math.yaml", *base, "data.reward_key=kind", "data.rewards={exact: mth}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did you mean 'math'" in err[0], err
