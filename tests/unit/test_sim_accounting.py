"""A step's simulated seconds (flash.sim.accounting): GPU time scaled back, driver time not.

- ``union_s`` counts overlapping spans once and clips them to the window.
- A step whose window is all GPU work is its wall time / time_scale; a gap where no simulated GPU
  worked is added unscaled, whichever role's spans cover the rest.
- ``simulated_metrics`` keeps the plain division as ``sim/step_scaled_s``; the run's mean
  (``SimSteps.seconds_per_step``, over the per-step windows) adds the time outside them unscaled.
- The simulated engine sleeps what is left of a step's scaled time after its own bookkeeping, and
  reports that scaled time, not the bookkeeping that ran past it, as its busy spans.
"""

from __future__ import annotations

import time

import pytest

from flash.engine.sim_engine import SimBatcher, SimSettings
from flash.sim import cost
from flash.sim.accounting import (
    SimSteps,
    late_warning,
    simulated_metrics,
    simulated_step_s,
    split_step,
    union_s,
)


def test_union_counts_overlaps_once_and_clips():
    assert union_s([[0, 2], [1, 3], [5, 6]], 0, 10) == pytest.approx(4.0)
    assert union_s([[-1, 1], [9, 12]], 0, 10) == pytest.approx(2.0)
    assert union_s([[0, 5], [1, 2]], 0, 10) == pytest.approx(5.0)
    assert union_s([], 0, 10) == 0.0


def _timeline(engine, **phases):
    return {"phases": phases, "engine_busy": engine}


def test_all_gpu_step_scales_whole_and_driver_gap_stays_unscaled():
    # sync-like: rollout 0-6 (engine), 1 s of driver work, train 7-9, push 9-10
    tl = _timeline([[0, 6]], get_batch=[0, 6.5], recompute_prox=[7, 7], train=[7, 9], push_weights=[9, 10])
    gpu, driver = split_step(10.0, tl)
    assert (gpu, driver) == (pytest.approx(9.0), pytest.approx(1.0))
    assert simulated_step_s(10.0, tl, 0.01) == (pytest.approx(901.0), pytest.approx(1.0))
    busy = _timeline([[0, 10]], get_batch=[0, 4], train=[4, 10])  # async-like: the engine never stops
    assert simulated_step_s(10.0, busy, 0.5) == (pytest.approx(20.0), pytest.approx(0.0))
    assert simulated_step_s(2.0, {"phases": {}}, 0.5) == (pytest.approx(4.0), pytest.approx(0.0))


def test_an_environment_step_in_flight_is_simulated_time_not_driver_time():
    # an episode step: the engine idle 2-6 while environment steps run 2-5; the gap 5-6 is the driver's
    tl = {**_timeline([[0, 2]], get_batch=[0, 6], train=[6, 8]), "env_busy": [[2, 4], [3, 5]]}
    assert split_step(8.0, tl) == (pytest.approx(7.0), pytest.approx(1.0))
    assert simulated_step_s(8.0, tl, 0.1) == (pytest.approx(71.0), pytest.approx(1.0))
    no_env = _timeline([[0, 2]], get_batch=[0, 6], train=[6, 8])
    assert split_step(8.0, no_env) == (pytest.approx(4.0), pytest.approx(4.0))


def test_metrics_keep_the_plain_division_and_the_run_mean_adds_the_gaps():
    tl = _timeline([[0, 6]], get_batch=[0, 6.5], train=[7, 9], push_weights=[9, 10])
    m = simulated_metrics({"time/step": 10.0, "time/train": 2.0, "reward/mean": 1.0}, 0.01, tl)
    assert m == {
        "sim/step_s": pytest.approx(901.0),
        "sim/driver_s": pytest.approx(1.0),
        "sim/step_scaled_s": pytest.approx(1000.0),
        "sim/train_s": pytest.approx(200.0),
    }
    later = _timeline([[11, 17]], get_batch=[11, 17.5], train=[18, 20], push_weights=[20, 21])  # 1 s idle before
    steps = SimSteps(0.01, out=lambda line: None)
    assert steps.seconds_per_step(3.0) == pytest.approx(300.0)  # no step seen: the train time scaled whole
    for i, timeline in enumerate((tl, later)):
        steps.metrics(i + 1, {"time/step": 10.0}, timeline)
    # step 2's window 10-21: 9 s of GPU, 2 s of driver (the gap and 17-18); 2 s of the train time outside
    assert steps.seconds_per_step(23.0) == pytest.approx((901.0 + 902.0 + 2.0) / 2)


def test_engine_sleeps_what_is_left_after_its_bookkeeping():
    b = SimBatcher(SimSettings(cost.PRESETS["qwen2.5-7b-h100"], instances=1, time_scale=1.0), 64, 4, seed=0)
    start, wall = time.monotonic(), time.time()
    b._pace((start - 0.05, wall - 0.05), 0.08)  # 50 ms already spent: ~30 ms left to sleep
    assert 0.02 <= time.monotonic() - start < 0.25 and b.late_s == 0.0  # sleep may overshoot on loaded cores
    b._pace((time.monotonic() - 0.5, wall + 1.0), 0.2)  # the bookkeeping ran 0.3 s past the step
    assert b.late_s == pytest.approx(0.3, abs=0.05)
    # the reported spans are the scaled GPU time only, not the late bookkeeping
    assert b.spans.drain() == [
        [pytest.approx(wall - 0.05), pytest.approx(wall + 0.03)],
        [pytest.approx(wall + 1.0), pytest.approx(wall + 1.2)],
    ]


def test_a_late_engine_is_named_with_the_fix():
    assert late_warning(3, 0.05, 1.0, 0.05) is None  # 5% of the step: within the reading's noise
    assert late_warning(3, 0.0, 0.0, 0.05) is None
    line = late_warning(3, 0.4, 1.0, 0.05)
    assert "step 3" in line and "40%" in line and "raise sim.time_scale (now 0.05)" in line
    said = []
    steps = SimSteps(0.05, out=said.append)
    for step, late_s in ((1, 0.01), (2, 0.5), (3, 0.6)):
        steps.metrics(step, {"rollout/sim_late_s": late_s, "time/step": 1.0}, {"phases": {"train": [step - 1, step]}})
    assert len(said) == 1 and "step 2" in said[0]  # once per run, at the first late step


def test_steps_are_counted_end_to_end_so_an_async_engines_work_between_them_is_kept():
    # async: step 1's phases 0-10, the driver logs 10-11 while the engine decodes on, step 2's
    # phases 11-20; the engine busy throughout
    one = _timeline([[0, 10]], get_batch=[0, 6], train=[6, 10])
    two = _timeline([[10, 20]], get_batch=[11, 15], train=[15, 20])
    steps = SimSteps(0.1, out=lambda line: None)
    first = steps.metrics(1, {"time/step": 10.0}, one)
    second = steps.metrics(2, {"time/step": 9.0}, two)
    assert first["sim/step_s"] == pytest.approx(100.0)
    assert second["sim/step_s"] == pytest.approx(100.0)  # 10-20: the 10-11 decode included
    assert simulated_step_s(9.0, two, 0.1) == (pytest.approx(90.0), pytest.approx(0.0))  # phases alone lose it
    assert steps.seconds_per_step(20.5) == pytest.approx((200.0 + 0.5) / 2)  # 0.5 s after: unscaled
    # an evaluation between two steps is not training time: the next window starts at its phases
    steps.metrics(3, {"time/step": 1.0, "time/eval": 5.0}, _timeline([], train=[20, 21]))
    after = steps.metrics(4, {"time/step": 1.0}, _timeline([[26, 27]], train=[26, 27]))
    assert after["sim/step_s"] == pytest.approx(10.0)
    # and the run's mean counts it alike: the evaluation's 21-26 unscaled, outside every window
    assert steps.seconds_per_step(27.0) == pytest.approx((100.0 + 100.0 + 10.0 + 10.0 + 5.0) / 4)
