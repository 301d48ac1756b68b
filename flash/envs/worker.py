"""``EnvWorker``: a Ray actor that holds live environments and steps them, one call per step.

The episode scheduler drives episodes (``controllers.episode_scheduler``); environments live here,
in their own process, so a slow or crashing game neither blocks the driver's threads nor shares
its interpreter. The actor is threaded (``max_concurrency``): steps of different episodes run at
once, each on its own environment; one episode has at most one step outstanding (the scheduler's
rule), so a single environment is never stepped concurrently.

A worker that dies (SIGKILL, out of memory) is restarted by Ray (``max_restarts``) with no
environments: a call for an episode it does not hold raises ``EnvLost``, and the scheduler re-runs
that episode from its reset (``controllers.episode_scheduler``).

A step is atomic: it runs to completion once called. ``applied(key)`` is the worker's own record
of the actions it applied to an episode, which the tests compare with the scheduler's transcript
("every action applied exactly once").
"""

from __future__ import annotations

import os
import threading
import time

from flash.envs.base import StepResult


class EnvLost(KeyError):
    """The worker holds no environment for this episode: it was restarted since the reset."""


class EnvWorker:
    def __init__(self, task_name: str, task_options: dict, step_delay_s: float = 0.0):
        from flash.tasks import make_task

        self.task = make_task(task_name, **task_options)
        self.step_delay_s = step_delay_s
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
                raise EnvLost(f"no live environment for episode {key!r} in worker {os.getpid()} "
                              f"(reset it first; a restarted worker holds none)")
            env = self._envs[key]
            self.counters["in_step"] += 1
        start = time.monotonic()
        try:
            if self.step_delay_s > 0:
                time.sleep(self.step_delay_s)
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


def start_env_workers(count: int, task_name: str, task_options: dict, step_delay_s: float = 0.0,
                      max_restarts: int = 0) -> list:
    """``count`` EnvWorker actors (no CPU reserved: they mostly wait on the engine); Ray restarts
    one that dies up to ``max_restarts`` times."""
    import ray

    actor = ray.remote(EnvWorker).options(num_cpus=0, max_concurrency=16, max_restarts=max_restarts)
    return [actor.remote(task_name, dict(task_options), step_delay_s) for _ in range(count)]
