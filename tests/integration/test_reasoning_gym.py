"""reasoning-gym datasets as a task (recipes/tasks/rgym.py): generated on the fly, scored by the
dataset's own ``score_answer``; bad names and options are one line naming the fix; the recipe
learns (margin)."""

from __future__ import annotations

import pytest

pytest.importorskip("reasoning_gym", reason="the reasoning-gym extra: pip install 'flash-rl[reasoning-gym]'")

from flash.recipes.tasks import make_task  # noqa: E402

CHAIN = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def test_items_are_generated_from_the_seed_and_scored_by_reasoning_gym():
    task = make_task("reasoning_gym", dataset="chain_sum", options=CHAIN, eval_size=8)
    item = task.item(2)
    assert item == make_task("reasoning_gym", dataset="chain_sum", options=CHAIN).item(2)
    assert item.prompt.startswith("State the final answer")
    a, op, b = item.prompt.rsplit(":", 1)[1].strip(" =").split()
    assert int(item.answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    assert task.reward(item, item.answer) == 1.0 and task.reward(item, f" {item.answer} ") == 1.0
    assert task.reward(item, str(int(item.answer) + 1)) == 0.0
    assert task.sft_pair(2) == (item.prompt, item.answer)
    assert [it.prompt for it in task.eval_items()] != [task.item(i).prompt for i in range(8)]
    low = make_task("reasoning_gym", dataset="chain_sum", options=CHAIN, lowercase=True)
    assert low.item(2).prompt == item.prompt.lower() and low.reward(low.item(2), item.answer) == 1.0


def test_slipped_demonstrations_are_one_too_high_at_the_rate_asked_and_items_are_unchanged():
    """``slip_prob`` changes the warm start's demonstrations only: an integer answer one too high
    at that rate (a bias the reward teaches away), the items and their rewards as without it."""
    plain = make_task("reasoning_gym", dataset="chain_sum", options=CHAIN)
    task = make_task("reasoning_gym", dataset="chain_sum", options=CHAIN, slip_prob=0.3)
    pairs, items = [task.sft_pair(i) for i in range(1000)], [plain.item(i) for i in range(1000)]
    assert [p for p, _ in pairs] == [it.prompt for it in items]
    off = [int(a) - int(it.answer) for (_, a), it in zip(pairs, items) if a != it.answer]
    assert set(off) == {1} and 0.26 <= len(off) / 1000 <= 0.34
    assert [task.sft_pair(i) for i in range(50)] == pairs[:50]  # the same index, the same demonstration
    with pytest.raises(ValueError, match=r"slip_prob must be in \[0, 1\)"):
        make_task("reasoning_gym", dataset="chain_sum", options=CHAIN, slip_prob=1.0)


@pytest.mark.parametrize(
    "options, error",
    [
        ({"dataset": "chain_summ"}, "did you mean 'chain_sum'"),
        ({"dataset": "chain_sum", "options": {"bogus": 1}}, "task.options for chain_sum: TypeError"),
        ({"dataset": "chain_sum", "options": {"seed": 3}}, "set task.seed / task.size instead"),
        ({"dataset": ""}, "task.dataset names a reasoning-gym dataset"),
    ],
)
def test_a_bad_dataset_or_option_is_one_line_naming_the_fix(options, error):
    with pytest.raises(ValueError) as caught:
        make_task("reasoning_gym", **options)
    assert error in str(caught.value) and "\n" not in str(caught.value)


def one_too_high_share(lines: list[dict]) -> float:
    """The share of held-out answers that are an integer one above the item's answer: the slip the
    warm start was taught (``slip_prob``) and the reward teaches away."""
    high = 0
    for line in lines:
        try:
            high += int(line["response"].strip()) == int(line["answer"]) + 1
        except ValueError:
            pass
    return high / len(lines)


def test_the_one_too_high_share_counts_only_answers_one_above():
    lines = [
        {"response": " 7", "answer": "6"},
        {"response": "6", "answer": "6"},
        {"response": "-2", "answer": "-3"},
        {"response": "5", "answer": "6"},
        {"response": "x", "answer": "6"},
    ]
    assert one_too_high_share(lines) == 0.4


@pytest.mark.slow
@pytest.mark.margin  # the 800-step warm start and 40 steps: ~9 minutes on 2 quiet cores
def test_the_reasoning_gym_recipe_learns(tmp_path, warm_cache):
    from tests.helpers.processes import read_jsonl, recipe_summary

    run_dir = tmp_path / "run"
    s = recipe_summary(run_dir, warm_cache, "recipes/reasoning_gym.yaml", ["tracking.tensorboard=false"], timeout=3000)
    assert s["steps"] == 40
    # Seven runs from one CPU's warm start (held-out 0.584; BENCHMARKS.md: the recipe at seeds 0 and 1,
    # synchronous, groups of 16, 32 prompts) gained +0.043 to +0.120, +0.079 on average, against a
    # paired standard error of ~0.025 over 128 items: the tiny model turns part of its one-too-high
    # answers into one-too-low ones. Every run cut the one-too-high share by 39-60 % (lr 5e-4: +0.020
    # and 29 %, below both bars). Another CPU's warm start (0.418) gained +0.139.
    assert s["eval_accuracy_final"] - s["eval_accuracy_initial"] >= 0.04, s
    before = one_too_high_share(read_jsonl(run_dir / "eval" / "eval" / "step-0.jsonl"))
    after = one_too_high_share(read_jsonl(run_dir / "eval" / "eval" / "step-40.jsonl"))
    assert after <= 2 / 3 * before, (before, after)
