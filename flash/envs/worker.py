"""``EnvWorker``: a Ray actor that holds live environments and steps them, one call per step.

The episode scheduler drives episodes (``flash.controllers.workflows.episode``); environments live here,
in their own process, so a slow or crashing game neither blocks the driver's threads nor shares
its interpreter. The actor is threaded (``max_concurrency``): steps of different episodes run at
once, each on its own environment; one episode has at most one step outstanding (the scheduler's
rule), so a single environment is never stepped concurrently.

A worker that dies (SIGKILL, out of memory) is restarted by Ray (``max_restarts``) with no
environments: a call for an episode it does not hold raises ``EnvLost``, and the scheduler re-runs
that episode from its reset (``flash.controllers.workflows.episode``).

A step is atomic: it runs to completion once called. ``applied(key)`` is the worker's own record
of the actions it applied to an episode, which the tests compare with the scheduler's transcript
("every action applied exactly once").
"""

from __future__ import annotations

import math
import os
import random
import threading
import time
import zlib

from flash.envs.base import StepResult


class EnvLost(KeyError):
    """The worker holds no environment for this episode: it was restarted since the reset."""


class EnvWorker:
    def __init__(self, task_name: str, task_options: dict, step_delay_s: float = 0.0, step_delay_sigma: float = 0.0):
        from flash.tasks import make_task

        self.task = make_task(task_name, **task_options)
        self.step_delay_s, self.step_delay_sigma = step_delay_s, step_delay_sigma
        self._envs: dict[str, object] = {}
        self._applied: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self.counters = {"resets": 0, "steps": 0, "step_s": 0.0, "in_step": 0}

    def reset(self, key: str, seed: int) -> str:
        env = self.task.make_env()
        obs = env.reset(seed)
        with self._lock:
            self._envs[key], self._applied[key] = env, []
            self.counters["resets"] += 1
        return obs

    def step(self, key: str, action: str) -> tuple:
        with self._lock:
            if key not in self._envs:
                raise EnvLost(
                    f"no live environment for episode {key!r} in worker {os.getpid()} "
                    f"(reset it first; a restarted worker holds none)"
                )
            env = self._envs[key]
            self.counters["in_step"] += 1
            delay = step_delay(self.step_delay_s, self.step_delay_sigma, key, len(self._applied[key]))
        start = time.monotonic()
        try:
            if delay > 0:
                time.sleep(delay)
            result = StepResult(*env.step(action))
        finally:
            with self._lock:
                self.counters["in_step"] -= 1
        with self._lock:
            self._applied[key].append(action)
            self.counters["steps"] += 1
            self.counters["step_s"] += time.monotonic() - start
        return tuple(result)

    def close(self, key: str) -> None:
        """Forget the episode's environment (its applied-actions record is kept for inspection)."""
        with self._lock:
            self._envs.pop(key, None)

    def applied(self, key: str) -> list[str]:
        with self._lock:
            return list(self._applied.get(key, []))

    def pid(self) -> int:
        return os.getpid()

    def stats(self) -> dict:
        with self._lock:
            return {**self.counters, "live": float(len(self._envs))}


def step_delay(median_s: float, sigma: float, key: str, step: int) -> float:
    """Seconds a step waits: ``median_s``, or lognormal around it with ``sigma`` (a long tail, as a
    tool or a remote environment has), drawn from (episode, step) so a replayed episode waits the same."""
    if median_s <= 0 or sigma <= 0:
        return max(0.0, median_s)
    rng = random.Random(zlib.crc32(f"{key}|{step}".encode()))
    return median_s * math.exp(sigma * rng.gauss(0.0, 1.0))


def start_env_workers(
    count: int,
    task_name: str,
    task_options: dict,
    step_delay_s: float = 0.0,
    max_restarts: int = 0,
    step_delay_sigma: float = 0.0,
    concurrency: int = 16,
) -> list:
    """``count`` EnvWorker actors (no CPU reserved: they mostly wait on the engine), each running
    ``concurrency`` calls at once; Ray restarts one that dies up to ``max_restarts`` times."""
    import ray

    actor = ray.remote(EnvWorker).options(num_cpus=0, max_concurrency=concurrency, max_restarts=max_restarts)
    return [actor.remote(task_name, dict(task_options), step_delay_s, step_delay_sigma) for _ in range(count)]
