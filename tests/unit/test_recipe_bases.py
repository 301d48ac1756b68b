"""Recipes build on each other (``base:``): a mapping set to ``{}`` or ``null`` empties the base's,
and a new choice of task (or of any mapping with a ``name``) starts from that choice's defaults,
in a recipe as on the command line."""

import pytest

from flash.app.config import load_config
from flash.app.merge import merge_layers
from flash.app.recipe_files import resolve_recipe


def recipe(tmp_path, text: str):
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("fn", ["{}", "null"])
def test_an_empty_or_null_mapping_under_base_empties_the_base_s(tmp_path, fn):
    assert load_config(resolve_recipe("math")).reward.fn == {"name": "math"}
    cfg = load_config(recipe(tmp_path, f"base: math\nreward:\n  fn: {fn}\n  num_workers: 2\n"))
    assert cfg.reward.fn == {} and cfg.reward.num_workers == 2


def test_a_new_task_name_on_the_command_line_drops_the_base_task_s_keys(capsys):
    cfg = load_config(resolve_recipe("math"), ["task.name=reasoning_gym", "task.dataset=leg_counting"])
    assert cfg.task == {"name": "reasoning_gym", "dataset": "leg_counting"}
    assert capsys.readouterr().err.strip() == (
        "flash: note: task.name=reasoning_gym replaces wordproblems: dropped task.ops, task.max_operand, "
        "task.slip_prob, task.eval_size (its keys; reasoning_gym starts from its own defaults)"
    )


def test_a_new_task_block_under_base_starts_from_that_task_s_defaults(tmp_path):
    cfg = load_config(recipe(tmp_path, "base: math\ntask:\n  name: reasoning_gym\n  dataset: leg_counting\n"))
    assert cfg.task == {"name": "reasoning_gym", "dataset": "leg_counting"}
    assert cfg.reward.fn == {"name": "math"} and cfg.train.steps == load_config(resolve_recipe("math")).train.steps
    cfg = load_config(recipe(tmp_path, "base: reasoning_gym\ntask:\n  dataset: leg_counting\n  options: {}\n"))
    assert cfg.task["name"] == "reasoning_gym" and cfg.task["dataset"] == "leg_counting" and cfg.task["options"] == {}


def test_layers_merge_keep_and_replace_as_stated():
    merged = merge_layers(
        [
            {"task": {"name": "a", "x": 1}, "reward": {"fn": {"name": "m", "k": 2}}},
            {"task": {"x": 3}, "reward": {"fn": None}},
            {"task": {"name": "b", "y": 4}},
        ]
    )
    assert merged.settings == {"task": {"name": "b", "y": 4}, "reward": {"fn": {}}}
    assert merged.whole == ["reward.fn", "task"] and merged.notes == [
        "task.name=b replaces a: dropped task.x (its keys; b starts from its own defaults)"
    ]
