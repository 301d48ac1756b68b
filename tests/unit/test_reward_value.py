"""One table of values against every place a reward enters a run (``flash.buffers.reward``): each takes
the same values as the same floats and refuses the same ones, so they cannot disagree."""

from __future__ import annotations

import math
import threading
from decimal import Decimal
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest

from flash.buffers import Group, Sample
from flash.buffers.reward import BadReward, reward_value

REFUSED = None
TABLE = [  # (value, the reward it is, or REFUSED)
    (1.5, 1.5),
    (-2.0, -2.0),
    (0, 0.0),
    (3, 3.0),
    (Fraction(1, 4), 0.25),
    (np.float32(0.5), 0.5),
    (np.float64(0.25), 0.25),
    (np.int64(-3), -3.0),
    (np.uint8(7), 7.0),
    (True, REFUSED),
    (False, REFUSED),
    (np.bool_(True), REFUSED),
    (math.nan, REFUSED),
    (math.inf, REFUSED),
    (-math.inf, REFUSED),
    (np.float32("nan"), REFUSED),
    (np.float64("-inf"), REFUSED),
    (10**400, REFUSED),
    ("1.0", REFUSED),
    (None, REFUSED),
    ([1.0], REFUSED),
    ((1.0,), REFUSED),
    (Decimal("0.5"), REFUSED),
    (np.array(0.5), REFUSED),
    (np.array([0.5]), REFUSED),
]
IDS = [f"{type(v).__name__}:{v!r}"[:40] for v, _ in TABLE]


def by_check(value):
    try:
        return reward_value(value)
    except BadReward:
        return REFUSED


def by_driver_score(value):
    """``RolloutCore.score``: a refused reward scores 0.0 and counts a reward error."""
    from flash.controllers.reward_errors import RewardErrors
    from flash.controllers.scheduler import RolloutCore

    core = SimpleNamespace(
        source=SimpleNamespace(reward=lambda item, text: value, decode=str),
        _lock=threading.Lock(),
        counters={"reward_errors": 0},
        reward_deadline_s=None,
        reward_errors=RewardErrors(),
    )
    score = RolloutCore.score(core, None, [1])
    return REFUSED if core.counters["reward_errors"] else score


def by_reward_pool(value):
    """The reward pool's worker: a refused reward scores 0.0 with reason ``error:BadReward``."""
    from flash.rewards.workers import RewardResult, _as_result

    plain, boxed = _as_result(value, 0.0), _as_result(RewardResult(value), 0.0)
    assert plain == boxed
    return REFUSED if plain.reason == "error:BadReward" else plain.reward


def by_agent(value):
    from flash.envs.agents import BadReturn, check_return

    try:
        reward, info = check_return((value, {}))
    except BadReturn:
        return REFUSED
    assert check_return(value) == (reward, info) == (reward, {})
    return reward


def by_environment_step(value):
    """An episode's step: a refused reward ends the episode as ``env_error`` with what it had."""
    from flash.controllers.workflows.base import Unit
    from flash.controllers.workflows.episode import EpisodeCodec, Episodes, _Episode
    from flash.buffers.trace import TokenTrace
    from flash.engine.base import SamplingParams
    from flash.envs.episode import Transcript, add_turn
    from flash.tasks import TaskItem

    class Core:
        n, counters, delivered = 1, {}, []

        def deliver(self, outs):
            self.delivered = self.delivered + outs

    worker = SimpleNamespace(close=SimpleNamespace(remote=lambda key: None))
    wf = Episodes([worker], EpisodeCodec(list, list, str), max_turns=1, env_threads=1)
    wf.core = core = Core()
    unit = Unit("1:0", 1, 0, TaskItem(index=0, prompt="", answer="", meta={"seed": 1}), [], SamplingParams())
    transcript = Transcript(TokenTrace([1, 2]), observations=["a"])
    add_turn(transcript, [3], [-0.5], [0], version_now=0)
    wf._live[unit.id] = ep = _Episode(unit, worker, 0, transcript=transcript, turns=1)
    wf._env = lambda ep, method, *args: ("b", value, True, {})
    try:
        wf._step(ep, "x")
        (out,) = core.delivered
        sample = wf.finish(unit, out)
    finally:
        wf.stop()
    return REFUSED if sample.finish_reason == "env_error" else sample.reward


def _group(value) -> Group:
    s = Sample(
        prompt_id=1,
        sample_index=0,
        prompt_ids=[1],
        response_ids=[2],
        behav_logprobs=[-0.5],
        versions=[0],
        reward=value,
        loss_mask=[1],
    )
    return Group(prompt_id=1, samples=[s], admitted_version=0, data_index=0)


def by_buffer_guard(value):
    """The buffer service refuses a group with such a reward (``bad_value``)."""
    from flash.buffers.guard import ValueLimits, check_values
    from flash.buffers.wire import WireError

    try:
        check_values(_group(value), ValueLimits(), max_version=0)
    except WireError as exc:
        assert exc.reason == "bad_value"
        return REFUSED
    return float(value)


def by_schedule(value):
    """A recorded schedule's line (``flash replay``) holding such a reward is refused."""
    from flash.app.schedule import groups_from_line, step_line
    from flash.errors import FlashError

    line = step_line(0, [_group(0.0)], {}, {})
    line["groups"][0]["samples"][0]["reward"] = value
    try:
        (group,) = groups_from_line(line)
    except FlashError:
        return REFUSED
    return group.samples[0].reward


ENTRY_POINTS = [by_check, by_driver_score, by_reward_pool, by_agent, by_environment_step, by_buffer_guard, by_schedule]


@pytest.mark.parametrize("value, want", TABLE, ids=IDS)
def test_every_entry_point_takes_and_refuses_the_same_rewards(value, want):
    got = {f.__name__: f(value) for f in ENTRY_POINTS}
    assert got == dict.fromkeys(got, want)
    assert all(type(r) is float for r in got.values() if r is not REFUSED)


def test_a_refusal_says_what_was_returned():
    with pytest.raises(BadReward, match="real number, not a str"):
        reward_value("1.0")
    with pytest.raises(BadReward, match="finite number, not nan"):
        reward_value(np.float32("nan"))
