"""A reward that fails (raises, or returns no reward) scores 0 and is counted, on every step's
metrics (``reward/errors``, ``reward/errors_in_a_row``); one that fails on
``reward.max_consecutive_errors`` training responses in a row stops the run with one line naming the
reward and its error (flash.controllers.reward_errors), wherever it was scored: the scheduler's reward
threads or a reward worker."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from flash.buffers.reward import ERROR_CHARS, RewardRaised, error_text
from flash.controllers.lifecycle import Outcomes
from flash.controllers.reward_errors import RewardErrors, score_response
from flash.controllers.thread_errors import ThreadErrors
from flash.app.config import load_config
from flash.app.resume import config_differences
from flash.app.schema import RewardConfig
from flash.errors import ConfigError, FlashError, RewardsFailing
from flash.tasks import TaskItem

STOP = (
    "reward 'he_score' failed on 3 training responses in a row, the run stopped "
    "(reward.max_consecutive_errors=3); its last error: NameError: name 'x' is not defined. Fix the reward "
    "(`flash data RECIPE` scores each row's reference with it), or set reward.max_consecutive_errors=0 to "
    "score such responses 0 and go on"
)


def core(reward, limit: int, name: str = "reward 'he_score'") -> SimpleNamespace:
    """The parts of the scheduler core ``score_response`` reads (its counters: the run's ``Outcomes``)."""
    outcomes = Outcomes()
    return SimpleNamespace(
        source=SimpleNamespace(reward=reward, decode=str),
        _lock=threading.Lock(),
        counters=outcomes.counters,
        reward_deadline_s=None,
        outcomes=outcomes,
        reward_errors=RewardErrors(limit, name),
    )


def undefined(item, text):
    return x  # noqa: F821 -- the reward's bug: a NameError on every call


def test_a_reward_failing_on_every_training_response_stops_the_run_at_the_limit_in_one_line():
    c = core(undefined, limit=3)
    item = TaskItem(0, "p", "1")
    assert c.outcomes.metrics()["reward/errors"] == 0.0 and c.reward_errors.metrics() == {"reward/errors_in_a_row": 0.0}
    assert [score_response(c, item, [1]) for _ in range(2)] == [0.0, 0.0]
    assert [score_response(c, item, [1], training=False) for _ in range(5)] == [0.0] * 5  # evaluation: no streak
    assert c.counters["reward_errors"] == 7 and c.outcomes.metrics()["reward/errors"] == 7.0
    assert c.reward_errors.metrics() == {"reward/errors_in_a_row": 2.0}
    with pytest.raises(RewardsFailing) as err:
        score_response(c, item, [1])
    assert str(err.value) == STOP and isinstance(err.value, FlashError)


def test_a_scored_response_ends_the_streak_and_a_limit_of_zero_never_stops():
    calls = iter([ValueError("bad"), ValueError("bad"), 1.0, ValueError("bad"), ValueError("bad")])

    def flaky(item, text):
        value = next(calls)
        if isinstance(value, Exception):
            raise value
        return value

    c = core(flaky, limit=3)
    assert [score_response(c, TaskItem(0, "p", "1"), [1]) for _ in range(5)] == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert c.reward_errors.metrics() == {"reward/errors_in_a_row": 2.0} and c.counters["reward_errors"] == 4
    never = core(undefined, limit=0)
    assert [score_response(never, TaskItem(0, "p", "1"), [1]) for _ in range(50)] == [0.0] * 50
    assert never.reward_errors.metrics() == {"reward/errors_in_a_row": 50.0}


def test_each_reward_a_data_reward_key_row_chooses_has_its_own_streak_and_name():
    def by_row(item, text):
        if item.meta["reward_fn"] == "exact":
            raise KeyError("tests")
        return 1.0

    c = core(by_row, limit=2, name="reward 'math'")
    exact, math = TaskItem(0, "p", "1", {"reward_fn": "exact"}), TaskItem(1, "p", "1", {"reward_fn": "math"})
    assert score_response(c, exact, [1]) == 0.0 and score_response(c, math, [1]) == 1.0  # math's ok: exact's goes on
    with pytest.raises(
        RewardsFailing,
        match=r"^reward 'exact' failed on 2 training responses in a row, .*"
        r"its last error: KeyError: 'tests'\. Fix",
    ):
        score_response(c, exact, [1])


def test_a_reward_worker_names_its_error_and_the_scheduler_counts_it_as_its_own():
    from flash.rewards.workers import RewardPool, RewardScorer

    worker = RewardScorer({"name": "tests.reward_fns:divide_by_zero"}, timeout_s=10.0)
    result, _ = worker.score(TaskItem(0, "p", "1"), "x")
    assert (result.reward, result.reason, result.error) == (
        0.0,
        "error:ZeroDivisionError",
        "ZeroDivisionError: division by zero",
    )
    nan, _ = RewardScorer({"name": "tests.reward_fns:not_a_number"}, timeout_s=10.0).score(TaskItem(0, "p", "1"), "x")
    assert nan.reason == "error:BadReward" and nan.error == "BadReward: a reward is a finite number, not nan"
    pool_fn = RewardPool.reward_fn(SimpleNamespace(score=lambda item, text: result))  # the pool's reward_fn
    with pytest.raises(RewardRaised, match=r"^ZeroDivisionError: division by zero$"):
        pool_fn(TaskItem(0, "p", "1"), "x")
    c = core(pool_fn, limit=2, name="reward 'code'")
    assert score_response(c, TaskItem(0, "p", "1"), [1]) == 0.0 and c.counters["reward_errors"] == 1
    with pytest.raises(
        RewardsFailing,
        match=r"^reward 'code' failed on 2 .* its last error: ZeroDivisionError: "
        r"division by zero\. Fix",
    ):
        score_response(c, TaskItem(0, "p", "1"), [1])


def test_an_error_is_named_on_one_bounded_line():
    assert error_text(ValueError("two\nlines\n  here")) == "ValueError: two lines here"
    assert error_text(RewardRaised("KeyError: 'tests'")) == "KeyError: 'tests'"
    long = error_text(RuntimeError("y" * 1000))
    assert len(long) == ERROR_CHARS and long.endswith("...")


def test_a_run_stop_raised_in_a_scheduler_thread_reaches_the_controller_as_itself():
    errors = ThreadErrors(lambda: None)
    stop = RewardsFailing(STOP)
    errors.guard(lambda: (_ for _ in ()).throw(stop))()
    with pytest.raises(RewardsFailing) as err:
        errors.check()
    assert err.value is stop  # the command line prints its one line (flash: error: ...), no traceback
    errors.guard(lambda: 1 / 0)()
    with pytest.raises(RuntimeError, match=r"^rollout scheduler failed: ZeroDivisionError"):
        errors.check()


def test_the_limit_is_a_stated_setting_checked_when_the_recipe_loads_and_may_change_on_resume():
    assert RewardConfig().max_consecutive_errors == 32
    assert load_config("recipes/math.yaml", ["reward.max_consecutive_errors=0"]).reward.max_consecutive_errors == 0
    with pytest.raises(
        ConfigError,
        match=r"^reward.max_consecutive_errors must be >= 0 \(reward errors in a row "
        r"that stop the run; 0: never\), got -1$",
    ):
        load_config("recipes/math.yaml", ["reward.max_consecutive_errors=-1"])
    assert (
        config_differences({"reward": {"max_consecutive_errors": 32}}, {"reward": {"max_consecutive_errors": 0}}) == []
    )


def test_the_stop_line_names_the_run_s_reward_as_the_recipe_chose_it():
    from flash.app.data import reward_name

    def cfg(fn=None, train=(), task="stutter"):
        return SimpleNamespace(
            reward=SimpleNamespace(fn=fn or {}),
            data=SimpleNamespace(train=list(train), reward="math"),
            task={"name": task},
        )

    assert [
        reward_name(c) for c in (cfg({"name": "code"}, ["h.jsonl"]), cfg(train=["d.jsonl"]), cfg(task="pyfunc"))
    ] == ["reward 'code'", "reward 'math'", "the pyfunc task's reward"]


def test_only_a_training_response_of_the_single_turn_workflow_counts_in_a_streak():
    from flash.controllers.workflows.base import Unit
    from flash.controllers.workflows.single_turn import SingleTurn
    from flash.engine.base import GenerationOutput, SamplingParams

    told: list[bool] = []
    workflow = SingleTurn()
    workflow.core = SimpleNamespace(score=lambda item, ids, training: told.append(training) or 0.5)  # type: ignore[assignment]
    out = GenerationOutput("r", [1], [2, 3], [0.0, 0.0], [0, 0], "stop")
    for prompt_id in (3, -1):  # a trained prompt, an evaluation's unit
        unit = Unit("r", prompt_id, 0, TaskItem(0, "p", "1"), [1], SamplingParams())
        assert workflow.finish(unit, out).reward == 0.5
    assert told == [True, False]


def test_the_warm_start_s_held_out_check_scores_a_failure_0_and_stops_in_one_line_when_every_one_fails():
    from flash.train.sft import held_out_rewards

    items = [TaskItem(i, "p", str(i)) for i in range(3)]
    assert held_out_rewards(lambda item, text: 1.0 if item.index else 1 / 0, items, ["a"] * 3) == [0.0, 1.0, 1.0]
    assert held_out_rewards(lambda item, text: float("nan") if item.index == 2 else 0.5, items, ["a"] * 3) == [
        0.5,
        0.5,
        0.0,
    ]
    with pytest.raises(RewardsFailing) as err:
        held_out_rewards(undefined, items, ["a"] * 3)
    assert str(err.value) == (
        "the reward failed on every one of the 3 held-out responses the warm start sampled "
        "(sft.eval_after); its last error: NameError: name 'x' is not defined. Fix the reward "
        "(`flash data RECIPE` scores each row's reference with it)"
    )
