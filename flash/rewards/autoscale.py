"""Reward-worker autoscaling (RollPacker's reward scheduler): the pool grows with its queue and
shrinks when a worker's worth of capacity has gone unused for a while, within a budget.

Why: reward load comes in bursts (a round's responses finish together; code rewards run seconds
each), so a fixed pool is either too small at the burst or idle between them. The decision is a
pure function, ``desired_workers``; ``Autoscaler`` keeps the one piece of state it needs (since
when the pool has had a spare worker) and ``ResizableSlots`` lets the pool's admission limit
(``workers × concurrency`` calls at once) follow the worker count.

Rule (``desired_workers(queue, workers, idle_s, cfg)``), with ``queue`` = calls in the pool
(running + waiting for a slot):

* up: when ``queue / workers > scale_up_queue``, to ``ceil(queue / scale_up_queue)`` workers
  (at least one more), so a burst is met in one step rather than one worker per tick;
* down: when the pool has had at least one worker's worth of unused slots for ``scale_down_idle_s``
  (``idle_s``), one worker fewer;
* always within ``[min_workers, max_workers]``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class AutoscaleConfig:
    min_workers: int
    max_workers: int
    scale_up_queue: float = 4.0  # calls per worker (running + waiting) above which workers are added
    scale_down_idle_s: float = 10.0  # a worker's capacity unused this long: one worker fewer
    interval_s: float = 0.25  # how often the pool's scaler looks at the queue

    def __post_init__(self) -> None:
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(
                f"reward autoscaling needs 1 <= min_workers <= max_workers, got "
                f"{self.min_workers} and {self.max_workers}"
            )
        if not (self.scale_up_queue > 0 and self.scale_down_idle_s >= 0 and self.interval_s > 0):
            raise ValueError("reward autoscaling needs scale_up_queue > 0, scale_down_idle_s >= 0 and interval_s > 0")


def desired_workers(queue: int, workers: int, idle_s: float, cfg: AutoscaleConfig) -> int:
    """How many workers the pool should have now (the module docstring's rule)."""
    want = workers
    if workers == 0 or queue / workers > cfg.scale_up_queue:
        want = max(workers + 1, math.ceil(queue / cfg.scale_up_queue))
    elif idle_s >= cfg.scale_down_idle_s and workers > cfg.min_workers:
        want = workers - 1
    return min(cfg.max_workers, max(cfg.min_workers, want))


class Autoscaler:
    """``observe(queue, workers, concurrency)`` → desired workers; tracks ``idle_s``: seconds since
    the calls in the pool last needed every worker (more than ``(workers − 1) × concurrency``).
    A change of size restarts that clock, so the pool shrinks one worker per idle period."""

    def __init__(self, cfg: AutoscaleConfig, clock: Callable[[], float] = time.monotonic):
        self.cfg, self.clock = cfg, clock
        self._last_needed = clock()
        self._size: int | None = None

    def observe(self, queue: int, workers: int, concurrency: int) -> int:
        now = self.clock()
        if workers != self._size or queue > (workers - 1) * concurrency:
            self._last_needed, self._size = now, workers
        return desired_workers(queue, workers, now - self._last_needed, self.cfg)


class ResizableSlots:
    """A counting semaphore whose capacity can change while held (``with slots:``): a shrink lets
    the calls already running finish; new ones wait until fewer than the capacity run."""

    def __init__(self, capacity: int):
        self._cv = threading.Condition()
        self._capacity, self._used = capacity, 0

    def __enter__(self):
        with self._cv:
            self._cv.wait_for(lambda: self._used < self._capacity)
            self._used += 1
        return self

    def __exit__(self, *exc) -> None:
        with self._cv:
            self._used -= 1
            self._cv.notify_all()

    def resize(self, capacity: int) -> None:
        with self._cv:
            self._capacity = capacity
            self._cv.notify_all()

    @property
    def capacity(self) -> int:
        return self._capacity


def run_scaler(pool, scaler: Autoscaler, stop: threading.Event) -> None:
    """The pool's scaling loop: every ``interval_s`` ask the scaler and resize the pool. A failed
    scale-up (a worker that does not start) is counted by the pool and tried again next tick."""
    while not stop.wait(scaler.cfg.interval_s):
        want = scaler.observe(pool.queued, pool.num_workers, pool.concurrency)
        if want != pool.num_workers:
            pool.resize(want)
