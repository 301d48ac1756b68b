"""Environment-worker faults for the episode workflow: an EnvWorker that dies or hangs costs its
episodes a replay from their reset, not the run.

Why a module of its own: this is the one part of the episode workflow that talks to Ray about
processes (pids, restarts, the hang timeout, the restart budget); the workflow itself only sees
``_EpisodeLost`` and plays the episode again. The mixin expects the workflow's ``workers``,
``_lock``, ``counters`` (``faults_env``: deaths, kept in the checkpoint with them), ``events``,
``on_event``, ``_pids``, ``hang_timeout_s`` and ``max_worker_restarts``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from flash.envs.worker import EnvLost
from flash.errors import FlashError

log = logging.getLogger("flash")


class EnvFailed(FlashError):
    """Environment workers kept dying after every restart the run allowed."""


class _EpisodeLost(Exception):
    """The episode's environment died with its worker: play it again from the reset."""


class _EpisodeHung(_EpisodeLost):
    """The episode's environment step hung again after a replay: the episode ends (``env_hung``)."""


HANG_REPLAYS = 1  # replays an episode gets after a hung step; a step that hangs again ends it
STARTUP_S = 300.0  # a worker's process must be up within this (a start, or Ray's restart)


class EnvWorkerFaults:
    """Fault handling of the scheduler's EnvWorkers (see the module docstring)."""

    # the host workflow's, which this mixin reads and writes
    workers: list[Any]  # the EnvWorker actor handles, one per slot
    hang_timeout_s: float
    max_worker_restarts: int
    counters: dict[str, float]
    events: list[dict]
    on_event: Callable[[dict], None] | None
    _pids: list[int] | None
    _lock: threading.Condition
    _count: Callable[[str], None]  # adds one to a counter (under ``_lock``)

    def pids(self) -> list[int]:
        """Each EnvWorker's process id (a changed one means Ray restarted it). Asked first while the
        workers start, which on a loaded machine takes longer than a step may hang."""
        pids = ray.get([w.pid.remote() for w in self.workers], timeout=max(self.hang_timeout_s, STARTUP_S))
        with self._lock:
            self._pids = list(pids)
        return list(pids)

    @property
    def faults(self) -> int:
        """Environment workers that died (``faults/env``)."""
        return int(self.counters.get("faults_env", 0))

    def _env(self, ep, method: str, *args):
        """One call on the episode's EnvWorker, bounded by ``hang_timeout_s``. Its worker dead,
        hung (then killed) or restarted since the reset: the fault is handled (``_worker_lost``)
        and ``_EpisodeLost`` raised -- ``_EpisodeHung`` when the episode already hung
        ``HANG_REPLAYS`` times (a replay plays the same seeds into the same step: an environment
        that hangs on it would kill its worker for ever); an exception the environment raised
        passes through."""
        try:
            return ray.get(getattr(ep.worker, method).remote(*args), timeout=self.hang_timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            ray.kill(ep.worker, no_restart=False)  # hung: treated as dead; Ray restarts it
            self._worker_lost(ep.slot, "hung", exc)
            ep.hangs += 1
            if ep.hangs > HANG_REPLAYS:  # a replay reaches the same step (same seeds): it would hang for ever
                raise _EpisodeHung from exc
        except ray.exceptions.RayActorError as exc:
            self._worker_lost(ep.slot, "died", exc)
        except ray.exceptions.RayTaskError as exc:
            if not isinstance(exc.cause, EnvLost):
                raise
            self._worker_lost(ep.slot, "died", exc)
        with self._lock:
            self._count("episodes_restarted")
        raise _EpisodeLost

    def _worker_lost(self, slot: int, kind: str, exc: BaseException) -> None:
        """Wait until Ray restarted worker ``slot``; count the fault once per new process (many
        episodes notice one death), log the first, stop the run past ``max_worker_restarts``."""
        start, wall = time.monotonic(), time.time()
        pid = self._wait_restarted(slot, kind, exc)
        with self._lock:
            if self._pids is not None and self._pids[slot] == pid:
                return  # this death was counted by another episode of the worker
            if self._pids is not None:
                self._pids[slot] = pid
            self.counters["faults_env"] = faults = self.faults + 1
        if faults > self.max_worker_restarts:
            raise EnvFailed(
                f"environment workers died {faults} times (rollout.max_worker_restarts="
                f"{self.max_worker_restarts}); last: {exc!r}"
            )
        if faults == 1:
            log.warning(
                "flash: an environment worker %s (%s); Ray restarted it and its episodes play again "
                "from their reset (faults counted in faults/env, logged once)",
                kind,
                type(exc).__name__,
            )
        event = {
            "event": "env_fault",
            "kind": kind,
            "error": type(exc).__name__,
            "time": wall,
            "worker": slot,
            "recovery_s": time.monotonic() - start,
            "pid": pid,
        }
        with self._lock:
            self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)

    def _wait_restarted(self, slot: int, kind: str, exc: BaseException) -> int:
        """The pid of worker ``slot`` once it answers again (``ActorUnavailableError`` while Ray
        restarts it); dead for good or not back within ``max(hang_timeout_s, 300)`` s: ``EnvFailed``."""
        deadline = time.monotonic() + max(self.hang_timeout_s, STARTUP_S)
        while True:
            try:
                return ray.get(self.workers[slot].pid.remote(), timeout=max(1.0, deadline - time.monotonic()))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
                restarting = isinstance(err, ray.exceptions.ActorUnavailableError)
                if not restarting or time.monotonic() >= deadline:
                    raise EnvFailed(
                        f"environment worker {slot} did not come back after it {kind} ({exc!r}): "
                        f"{err!r}. It is restarted at most rollout.max_worker_restarts="
                        f"{self.max_worker_restarts} times"
                    ) from err
                time.sleep(0.2)
