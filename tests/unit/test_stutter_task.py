"""The default task: deterministic items, verifiable reward, the stutter noise rate, long tail."""

import random
import statistics

import pytest

from flash.recipes.tasks import make_task
from flash.recipes.tasks.stutter import stutter


def test_items_are_deterministic_and_splits_differ():
    task = make_task("stutter")
    assert task.item(7) == task.item(7)
    train = {task.item(i).prompt for i in range(300)}
    evals = {task.item(i, "eval").prompt for i in range(300)}
    assert len(train & evals) < 30  # only some very short strings coincide
    item = task.item(3)
    assert item.prompt == item.answer + ":"
    assert len(set(item.answer)) == len(item.answer)  # distinct letters


def test_reward_is_exact_copy():
    task = make_task("stutter")
    item = task.item(0)
    assert task.reward(item, item.answer) == 1.0
    assert task.reward(item, item.answer + " ") == 1.0
    assert task.reward(item, item.answer[0] + item.answer) == 0.0
    assert task.reward(item, "") == 0.0


def test_sft_noise_rate_matches_slip_prob():
    rng = random.Random(0)
    text = "abcdefghijklmnopqrstuvwxyz" * 40
    out = stutter(text, rng, 0.15)
    assert out.replace("aa", "a").count("a") == 40
    assert (len(out) - len(text)) / len(text) == pytest.approx(0.15, abs=0.02)
    task = make_task("stutter", slip_prob=0.0)
    prompt, response = task.sft_pair(5)
    assert prompt == response + ":"


def test_lengths_have_a_long_tail():
    task = make_task("stutter")
    lengths = [len(task.item(i).answer) for i in range(2000)]
    median, p99 = statistics.median(lengths), sorted(lengths)[int(0.99 * len(lengths))]
    assert median <= 4 and p99 >= 4 * median and max(lengths) <= 24


def test_unknown_option_names_the_closest():
    with pytest.raises(ValueError, match="slip_prob"):
        make_task("stutter", slip_prb=0.1)
