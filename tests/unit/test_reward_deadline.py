"""One response's reward ends within ``reward.response_deadline_s`` across all its tests
(flash.rewards.deadline): a code row whose every test loops is cut at the deadline, not after one
sandbox timeout per test; the sandbox run in flight is killed then (none of its processes is
left); the response scores 0 with the named outcome ``reward_deadline``, counted in every step's
metrics (``reward/deadline``), in the scheduler's reward threads and in a reward worker alike.
Real sandbox runs (the loops run in their own processes, so this process's CPU stays small)."""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import pytest

from flash.controllers.lifecycle import Outcomes
from flash.controllers.reward_errors import RewardErrors
from flash.controllers.scheduler import RolloutCore
from flash.app.config import load_config
from flash.app.schema import RewardConfig
from flash.errors import ConfigError
from flash.rewards import sandbox
from flash.rewards.builtin import CodeReward
from flash.rewards.deadline import RewardDeadline, response_deadline
from flash.rewards.workers import RewardPool, RewardScorer
from flash.tasks import TaskItem

LOOP = "while True:\n    pass\n"
TESTS = 6  # stdin tests: one sandbox run each, t_max apiece without a response deadline
ROW = TaskItem(0, "loop", "", meta={"tests": [{"stdin": "", "stdout": "1"}] * TESTS})


def descendants(pid: int | None = None) -> set[int]:
    """Every live process below ``pid`` (this one by default), from /proc."""
    out, frontier = set(), [pid or os.getpid()]
    while frontier:
        p = frontier.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except FileNotFoundError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = {int(k) for k in f.read().split()}
            except FileNotFoundError:
                continue
            frontier += sorted(kids - out)
            out |= kids
    return out


@pytest.fixture
def idle_tree():
    """The fork server started (by one real call) and this process's tree at rest."""
    assert sandbox.execute("print(1)").status == "ok"
    return descendants()


def code_reward() -> CodeReward:
    return CodeReward(adaptive=False, t_min=5.0, t_max=5.0)  # 6 tests x 5 s = 30 s without a deadline


def core(reward, deadline_s: float | None) -> SimpleNamespace:
    """The scheduler core's parts ``RolloutCore.score`` reads (its counters: the run's ``Outcomes``)."""
    outcomes = Outcomes()
    return SimpleNamespace(
        source=SimpleNamespace(reward=reward, decode=lambda ids: LOOP),
        _lock=threading.Lock(),
        counters=outcomes.counters,
        reward_deadline_s=deadline_s,
        outcomes=outcomes,
        reward_errors=RewardErrors(),
    )


def test_a_row_of_looping_tests_scores_zero_at_the_deadline_with_its_sandbox_run_killed(idle_tree):
    scorer = code_reward()
    c = core(scorer, deadline_s=1.0)
    t0 = time.monotonic()
    assert RolloutCore.score(c, ROW, [1]) == 0.0
    wall = time.monotonic() - t0
    assert 1.0 <= wall < 3.0  # one deadline, not 6 sandbox timeouts of 5 s
    assert descendants() == idle_tree  # the looping run's processes are gone
    assert c.counters["reward_deadline"] == 1 and c.counters["reward_errors"] == 0
    assert c.outcomes.metrics()["reward/deadline"] == 1.0
    assert sandbox.leaked() == 0


def test_a_deadline_that_passed_runs_no_more_tests_and_a_reward_that_swallows_it_is_still_named(idle_tree):
    runs = []

    def swallowing(item, text):
        for _ in range(TESTS):
            try:
                runs.append(sandbox.execute("import time\ntime.sleep(0.4)\n", timeout_s=5.0).status)
            except RewardDeadline:
                runs.append("refused")
        return 1.0

    c = core(swallowing, deadline_s=1.0)
    assert RolloutCore.score(c, ROW, [1]) == 0.0 and c.counters["reward_deadline"] == 1
    first_cut = runs.index("refused")  # 0.4 s each: one or two run, the one in flight at 1.0 s is cut
    assert runs[:first_cut] == ["ok"] * first_cut and 1 <= first_cut <= 2
    assert runs[first_cut:] == ["refused"] * (TESTS - first_cut)  # none runs after the deadline
    assert descendants() == idle_tree


def test_an_outer_deadline_that_ends_sooner_holds_and_no_deadline_leaves_the_timeout_alone(idle_tree):
    with response_deadline(0.5) as outer, response_deadline(30.0) as inner:
        with pytest.raises(RewardDeadline, match=r"response_deadline_s=0.5s"):
            sandbox.execute(LOOP, timeout_s=5.0)
    assert inner.hit and outer.hit
    with response_deadline(None) as none:
        assert none is None and sandbox.execute(LOOP, timeout_s=0.3).status == "timeout"
    assert descendants() == idle_tree


def test_a_reward_worker_ends_the_call_at_the_deadline_with_nothing_stuck(idle_tree):
    worker = RewardScorer(
        {"name": "code", "adaptive": False, "t_min": 5.0, "t_max": 5.0}, timeout_s=60.0, response_deadline_s=1.0
    )
    t0 = time.monotonic()
    result, stuck = worker.score(ROW, LOOP)
    assert result.reward == 0.0 and result.reason == "reward_deadline" and stuck == 0
    assert time.monotonic() - t0 < 3.0 and descendants() == idle_tree
    pool = SimpleNamespace(score=lambda item, text: result)  # the pool's reward_fn on that result
    with pytest.raises(RewardDeadline):
        RewardPool.reward_fn(pool)(ROW, LOOP)  # the scheduler counts it as its own


def test_the_deadline_is_a_typed_setting_checked_when_the_recipe_loads():
    assert RewardConfig().response_deadline_s == 60.0
    with pytest.raises(
        ConfigError,
        match=r"^reward.response_deadline_s must be a finite number of seconds > 0 "
        r"\(one response's scoring, all its tests\), got 0.0$",
    ):
        load_config("recipes/code.yaml", ["reward.response_deadline_s=0"])
    with pytest.raises(ConfigError, match=r"^reward.response_deadline_s=nan is not a finite number"):
        load_config("recipes/code.yaml", ["reward.response_deadline_s=nan"])
