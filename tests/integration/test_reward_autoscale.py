"""Reward-worker autoscaling (flash.rewards.autoscale): the decision rule on hand-computed
cases, the idle clock, the resizable slot limit, config checks, and a Ray pool with a slow reward
that grows under load, shrinks after, never leaves its budget and loses no call."""

import threading
import time

import pytest
import ray

from flash.errors import ConfigError
from flash.rewards.autoscale import (
    AutoscaleConfig,
    Autoscaler,
    ResizableSlots,
    desired_workers,
)
from flash.cluster import init_ray
from flash.tasks import TaskItem

CFG = AutoscaleConfig(min_workers=1, max_workers=4, scale_up_queue=2.0, scale_down_idle_s=5.0)


@pytest.mark.parametrize(
    "queue, workers, idle_s, want",
    [
        (0, 1, 0.0, 1),  # nothing queued, not idle long enough: stay
        (2, 1, 0.0, 1),  # 2 per worker is not above 2
        (3, 1, 0.0, 2),  # 3 > 2: ceil(3 / 2) = 2
        (7, 1, 0.0, 4),  # a burst: ceil(7 / 2) = 4 at once
        (50, 2, 0.0, 4),  # capped at max_workers
        (5, 2, 0.0, 3),  # 2.5 > 2: ceil(5 / 2) = 3
        (4, 3, 0.0, 3),  # 1.33 per worker, not idle: stay
        (0, 3, 5.0, 2),  # idle for scale_down_idle_s: one fewer
        (0, 3, 60.0, 2),  # only one at a time, however long
        (0, 1, 60.0, 1),  # never below min_workers
        (0, 0, 0.0, 1),  # an empty pool comes back to min_workers
        (9, 4, 99.0, 4),  # busy beats idle (queue 2.25 > 2), and max caps it
    ],
)
def test_desired_workers_hand_computed(queue, workers, idle_s, want):
    assert desired_workers(queue, workers, idle_s, CFG) == want


def test_autoscaler_idle_clock_shrinks_one_worker_per_idle_period():
    now = [0.0]
    scaler = Autoscaler(CFG, clock=lambda: now[0])
    # 3 workers × concurrency 1: the queue needs all 3 while it exceeds (3 − 1) × 1 = 2
    assert scaler.observe(3, 3, 1) == 3  # 1 per worker: no growth
    now[0] = 4.0
    assert scaler.observe(2, 3, 1) == 3  # fits in 2 workers, but only for 4 s: not yet
    now[0] = 9.0
    assert scaler.observe(0, 3, 1) == 2  # 9 s since all 3 were needed (>= 5)
    now[0] = 10.0
    assert scaler.observe(0, 2, 1) == 2  # the size changed: the idle clock restarts
    now[0] = 15.0
    assert scaler.observe(0, 2, 1) == 1
    now[0] = 16.0
    assert scaler.observe(3, 1, 1) == 2  # load again: 3 per worker > 2 -> ceil(3 / 2)


def test_resizable_slots_limit_follows_capacity():
    slots, running, peak, lock = ResizableSlots(2), [0], [0], threading.Lock()
    release = threading.Event()

    def hold():
        with slots:
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
            release.wait(5)
            with lock:
                running[0] -= 1

    threads = [threading.Thread(target=hold) for _ in range(5)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    assert running[0] == 2  # the capacity holds the other three
    slots.resize(4)
    time.sleep(0.3)
    assert running[0] == 4  # growing lets two more in
    slots.resize(1)  # shrinking lets the running ones finish
    release.set()
    for t in threads:
        t.join(5)
    assert (running[0], peak[0], slots.capacity) == (0, 4, 1)


def test_autoscale_config_checked():
    from flash.app.config import load_config

    with pytest.raises(ConfigError, match="min_workers <= max_workers"):
        load_config("recipes/stutter.yaml", ["reward.fn.name=math", "reward.max_workers=2", "reward.min_workers=3"])
    with pytest.raises(ConfigError, match="starting size"):
        load_config("recipes/stutter.yaml", ["reward.fn.name=math", "reward.max_workers=4", "reward.num_workers=6"])
    with pytest.raises(ConfigError, match="did you mean 'max_workers'"):
        load_config("recipes/stutter.yaml", ["reward.max_worker=4"])
    cfg = load_config("recipes/stutter.yaml", ["reward.fn.name=math", "reward.max_workers=4"])
    from flash.rewards.workers import autoscale_config

    assert autoscale_config(cfg.reward) == AutoscaleConfig(1, 4, 4.0, 10.0)
    assert autoscale_config(load_config("recipes/stutter.yaml", ["reward.fn.name=math"]).reward) is None


@pytest.mark.slow
def test_pool_grows_under_load_shrinks_after_within_budget_and_loses_no_call():
    from flash.rewards.workers import RewardPool

    init_ray(None, num_cpus=2)
    cfg = AutoscaleConfig(min_workers=1, max_workers=3, scale_up_queue=1.0, scale_down_idle_s=1.0, interval_s=0.1)
    pool = RewardPool(
        {"name": "tests.reward_fns:slow", "seconds": 0.4}, num_workers=1, concurrency=1, timeout_s=30, autoscale=cfg
    )
    sizes, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            sizes.append(pool.num_workers)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    results: list = [None] * 24
    try:
        together = threading.Barrier(24)  # the burst arrives at once, as a round's responses do

        def call(i):
            together.wait(30)
            results[i] = pool.score(TaskItem(i, "p", ""), "x")

        callers = [threading.Thread(target=call, args=(i,)) for i in range(24)]
        for t in callers:
            t.start()
        for t in callers:
            t.join(120)
        busy_max = max(sizes)
        m = pool.metrics()
        deadline = time.monotonic() + 60
        while pool.num_workers > 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        final = pool.num_workers
    finally:
        stop.set()
        watcher.join()
        pool.close()
        ray.shutdown()
    assert all(r is not None and (r.reward, r.reason) == (1.0, "ok") for r in results)  # none lost
    assert m["reward/calls"] == 24.0 and m.get("reward/failures/error:WorkerDied", 0.0) == 0.0
    assert busy_max == 3 and max(sizes) <= 3 and min(sizes) >= 1  # grew to the budget, never past it
    assert m["reward/scale_ups"] >= 1 and "reward/workers" in m and "reward/queue" in m
    assert final == 1  # shrank back to min_workers once idle
