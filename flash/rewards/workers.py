"""Reward workers (Ray actors) and the ``RewardPool`` client the rollout scheduler calls.

Why actors: a code reward spends seconds in sandboxes and a math reward in sympy; scoring must
not share the driver's GIL with the scheduler's threads, and it scales by adding workers.

Failure is an outcome, never a crash: a reward function that raises scores 0.0 with
reason ``error:<ExcType>``; one that returns no reward (``flash.buffers.reward``: NaN, inf, a str, ...)
scores 0.0 with reason ``error:BadReward``; one that overruns ``timeout_s`` scores 0.0 with reason
``timeout``; one whose sandbox runs pass the response's deadline (``flash.rewards.deadline``: the
sooner of ``response_deadline_s`` and ``timeout_s``; the run is killed at it) scores 0.0 with
reason ``reward_deadline``, which the pool's ``reward_fn`` raises as ``RewardDeadline`` so the
scheduler counts it as it counts its own (``reward/deadline``). Each reason is counted in
``metrics()`` as ``reward/failures/<reason>``; the run continues. An ``error:`` result carries
its error's text (``flash.buffers.reward.error_text``), which ``reward_fn`` raises as ``RewardRaised``:
the scheduler counts it as a reward error, as it counts its own (``reward/errors``, and the stop
of a run whose reward fails on every response, ``reward.max_consecutive_errors``).

A worker that dies (its process killed, out of memory) is a fault, not an outcome: the
pool replaces it, and every call that was running on it is issued again on a live worker, so the
response is scored once, for real, never 0 for a crash. Each death is counted in ``faults/reward``,
logged once, and reported to ``on_event`` (``events.jsonl``: the seconds from the failed call to a
ready replacement); after ``max_restarts`` deaths the next one stops the run (``RewardFailed``).

Concurrency: each worker runs at most ``concurrency`` calls at once (Ray ``max_concurrency``), and
the pool submits at most ``num_workers * concurrency`` calls (a semaphore), so a call's deadline
starts when it starts running, not while it waits in an actor's queue.

A Python thread cannot be killed, so a call that overruns keeps running in the worker after it
has been answered ``timeout``; such *stuck* calls are counted, and a worker with more than
``max_stuck`` is killed and replaced (``reward/worker_restarts``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass

import ray

from flash.algos.registry import load_plugins
from flash.buffers.reward import BadReward, RewardRaised, error_text, reward_value
from flash.errors import FlashError
from flash.rewards.autoscale import (
    AutoscaleConfig,
    Autoscaler,
    ResizableSlots,
    run_scaler,
)
from flash.rewards.deadline import OUTCOME as DEADLINE
from flash.rewards.deadline import RewardDeadline, score_within
from flash.rewards.registry import build_reward, check_pool_args
from flash.usage import process_tree_cpu_s

log = logging.getLogger("flash")

GRACE_S = 5.0  # extra client-side wait beyond the worker's own deadline (actor call overhead)
STARTUP_S = 300.0  # a worker must be ready (process up, reward built) within this


@dataclass(frozen=True)
class RewardResult:
    reward: float
    reason: str = "ok"  # ok | timeout | reward_deadline | error:<ExcType>
    wall_s: float = 0.0
    error: str = ""  # an error:<ExcType> result's error (flash.buffers.reward.error_text)


def _as_result(value, wall_s: float) -> RewardResult:
    """A scorer's return value (a number or a RewardResult) as a RewardResult; a value that is no
    reward (``flash.buffers.reward``: NaN, inf, a str, ...) scores 0.0 with reason ``error:BadReward``."""
    try:
        reward = reward_value(value.reward if isinstance(value, RewardResult) else value)
    except BadReward as exc:
        return RewardResult(0.0, f"error:{BadReward.__name__}", wall_s, error_text(exc))
    reason = value.reason if isinstance(value, RewardResult) else "ok"
    return RewardResult(reward, reason, wall_s)


class RewardScorer:
    """One worker's state: the built scorer, a per-call deadline, the stuck-call count.
    Plain class so it is testable without Ray; ``RewardWorker`` is its actor form."""

    def __init__(
        self,
        section: dict,
        timeout_s: float,
        plugins: tuple[str, ...] = (),
        allow_unisolated: bool = False,
        response_deadline_s: float | None = None,
    ) -> None:
        from flash.rewards.sandbox import allow_unisolated as set_policy

        set_policy(allow_unisolated)
        load_plugins(list(plugins))
        self.scorer = build_reward(section)
        self.timeout_s = timeout_s
        self.deadline_s = min(timeout_s, response_deadline_s or timeout_s)  # its sandbox runs end by then
        self._stuck = 0
        self._lock = threading.Lock()

    def ready(self) -> bool:
        return True

    def pid(self) -> int:
        """The worker's process id (tests and benchmarks kill it to inject a fault)."""
        return os.getpid()

    def score(self, item, response: str) -> tuple[RewardResult, int]:
        """(result, calls still stuck in this worker)."""
        box: dict = {}
        t0 = time.monotonic()
        done = threading.Event()

        def run() -> None:
            try:
                box["value"] = score_within(self.deadline_s, self.scorer, item, response)
            except BaseException as exc:  # noqa: BLE001 - any failure is a named outcome
                box["error"] = exc
            finally:
                box["wall"] = time.monotonic() - t0
                with self._lock:
                    if box.get("abandoned"):
                        self._stuck -= 1
                    done.set()

        threading.Thread(target=run, daemon=True, name="reward-call").start()
        finished = done.wait(self.timeout_s)
        with self._lock:
            if not finished and not done.is_set():
                box["abandoned"] = True
                self._stuck += 1
            stuck = self._stuck
        if "wall" not in box or box.get("abandoned"):
            return RewardResult(0.0, "timeout", time.monotonic() - t0), stuck
        if isinstance(box.get("error"), RewardDeadline):
            return RewardResult(0.0, DEADLINE, box["wall"]), stuck
        if "error" in box:
            return RewardResult(
                0.0, f"error:{type(box['error']).__name__}", box["wall"], error_text(box["error"])
            ), stuck
        return _as_result(box["value"], box["wall"]), stuck

    def metrics(self) -> dict[str, float]:
        own = getattr(self.scorer, "metrics", None)
        out = dict(own()) if callable(own) else {}
        with self._lock:
            out["reward/stuck_calls"] = float(self._stuck)
        out["reward/cpu_s"] = process_tree_cpu_s()  # this worker's process and its sandbox runs
        return out


RewardWorker = ray.remote(num_cpus=0)(RewardScorer)


class RewardFailed(FlashError):
    """Reward workers kept dying after every replacement the run allowed."""


class _WorkerDied(Exception):
    """A call's worker died under it (internal: the call is issued again)."""


class RewardPool:
    """Client of ``num_workers`` reward actors; ``score`` is thread-safe and blocking.

    ``autoscale`` (flash.rewards.autoscale): the worker count follows the pool's queue within
    ``[min_workers, max_workers]``, starting at ``num_workers``; a worker leaves only when idle."""

    def __init__(
        self,
        section: dict,
        num_workers: int = 2,
        concurrency: int = 4,
        timeout_s: float = 30.0,
        plugins: tuple[str, ...] = (),
        max_stuck: int = 4,
        max_restarts: int = 10,
        autoscale: AutoscaleConfig | None = None,
        allow_unisolated: bool = False,
        response_deadline_s: float | None = None,
    ) -> None:
        check_pool_args(section, num_workers, concurrency, timeout_s, plugins)
        self.section, self.plugins = dict(section), tuple(plugins)
        self.allow_unisolated, self.response_deadline_s = allow_unisolated, response_deadline_s
        self.concurrency, self.timeout_s, self.max_stuck = concurrency, timeout_s, max_stuck
        self.max_restarts = max_restarts
        self._lock = threading.Lock()
        self._replace_lock = threading.RLock()  # one replacement at a time; callers of a dead worker wait
        self._slots = ResizableSlots(num_workers * concurrency)
        self._queued = 0  # calls in score(): waiting for a slot or running
        self._workers = self._spawn(num_workers)
        self._inflight = [0] * num_workers
        self.counters: Counter[str] = Counter()
        self.faults = 0  # workers that died (faults/reward)
        self.events: list[dict] = []
        self.on_event = None  # each death, once its replacement is ready (flash.app.runner: events.jsonl)
        self._wall_total = 0.0
        self._wall_max = 0.0
        self._stop = threading.Event()
        if autoscale is not None:
            threading.Thread(
                target=run_scaler, args=(self, Autoscaler(autoscale), self._stop), daemon=True, name="reward-autoscale"
            ).start()

    def _spawn(self, n: int) -> list:
        """Start ``n`` workers and wait until they are ready, so that a call's deadline never
        includes a worker's start (seconds on a loaded machine)."""
        workers = [
            RewardWorker.options(max_concurrency=self.concurrency).remote(
                self.section, self.timeout_s, self.plugins, self.allow_unisolated, self.response_deadline_s
            )
            for _ in range(n)
        ]
        try:
            ray.get([w.ready.remote() for w in workers], timeout=STARTUP_S)
        except ray.exceptions.GetTimeoutError:
            for w in workers:
                ray.kill(w, no_restart=True)
            raise RuntimeError(f"reward workers not ready after {STARTUP_S:.0f} s") from None
        return workers

    def pids(self) -> list[int]:
        return ray.get([w.pid.remote() for w in list(self._workers)], timeout=60)

    def score(self, item, response: str) -> RewardResult:
        with self._lock:
            self._queued += 1
        try:
            return self._score(item, response)
        finally:
            with self._lock:
                self._queued -= 1

    def _score(self, item, response: str) -> RewardResult:
        """Score on the least-busy worker; a worker that dies mid-call is replaced and the call
        issued again (each retry follows a replacement, so the retries are bounded by
        ``max_restarts``)."""
        with self._slots:
            while True:
                with self._lock:
                    i = min(range(len(self._workers)), key=self._inflight.__getitem__)
                    worker = self._workers[i]
                    self._inflight[i] += 1
                try:
                    result, stuck = self._call(worker, item, response)
                    break
                except _WorkerDied as exc:
                    self._replace_dead(i, worker, exc)
                    with self._lock:
                        self.counters["reissued"] += 1
                finally:
                    with self._lock:
                        self._inflight[i] -= 1
        if stuck > self.max_stuck:
            self._replace(i, worker)
        self._record(result)
        return result

    def _call(self, worker, item, response: str) -> tuple[RewardResult, int]:
        t0 = time.monotonic()
        ref = worker.score.remote(item, response)
        try:
            return ray.get(ref, timeout=self.timeout_s + GRACE_S)
        except ray.exceptions.GetTimeoutError:
            return RewardResult(0.0, "timeout", time.monotonic() - t0), self.max_stuck + 1
        except ray.exceptions.RayActorError as exc:
            raise _WorkerDied(type(exc).__name__) from exc

    def _replace(self, i: int, worker) -> bool:
        """Swap a fresh worker in for ``worker`` at slot ``i``, then kill the old one (a stuck one
        serves on meanwhile). False: another thread replaced it already."""
        with self._replace_lock:
            if i >= len(self._workers) or self._workers[i] is not worker:
                return False  # replaced, or scaled away
            fresh = self._spawn(1)[0]
            with self._lock:
                self._workers[i] = fresh
                self.counters["worker_restarts"] += 1
        ray.kill(worker, no_restart=True)
        return True

    def _replace_dead(self, i: int, worker, exc: _WorkerDied) -> None:
        """A worker died: count the fault (once per worker, however many calls it failed), log the
        first, stop the run past ``max_restarts``, replace it. Its callers wait for the replacement
        (``_replace_lock``) and then issue their calls again."""
        start, wall = time.monotonic(), time.time()
        with self._replace_lock:
            if i >= len(self._workers) or self._workers[i] is not worker:
                return  # replaced by another caller of the same dead worker
            with self._lock:
                self.faults += 1
                faults = self.faults
            if faults > self.max_restarts:
                raise RewardFailed(
                    f"reward worker died again after {self.max_restarts} replacements "
                    f"(rollout.max_worker_restarts={self.max_restarts}); look for what kills "
                    f"it (memory, the reward function)"
                ) from exc
            if faults == 1:
                log.warning(
                    "flash: a reward worker died (%s); replacing it and scoring its calls again "
                    "(faults counted in faults/reward, logged once)",
                    exc,
                )
            self._replace(i, worker)
        event = {
            "event": "reward_fault",
            "kind": "died",
            "error": str(exc),
            "time": wall,
            "recovery_s": time.monotonic() - start,
            "worker": i,
        }
        with self._lock:
            self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)

    @property
    def num_workers(self) -> int:
        with self._lock:
            return len(self._workers)

    @property
    def queued(self) -> int:
        with self._lock:
            return self._queued

    def resize(self, n: int) -> None:
        """Grow to ``n`` workers (started and ready before they take calls), or shrink towards it
        by removing idle workers from the end (a busy one stays until a later call)."""
        grow = n - self.num_workers
        if grow > 0:
            try:
                fresh = self._spawn(grow)
            except RuntimeError:
                with self._lock:
                    self.counters["scale_failures"] += 1
                return
            with self._lock:
                if self._stop.is_set():  # closed meanwhile: the new workers must not outlive the pool
                    for worker in fresh:
                        ray.kill(worker, no_restart=True)
                    return
                self._workers += fresh
                self._inflight += [0] * len(fresh)
                self.counters["scale_ups"] += 1
                self._slots.resize(len(self._workers) * self.concurrency)
            return
        removed = []
        with self._replace_lock, self._lock:  # never while a slot is being replaced
            while len(self._workers) > max(1, n) and self._inflight[-1] == 0:
                removed.append(self._workers.pop())
                self._inflight.pop()
            self._slots.resize(len(self._workers) * self.concurrency)
            self.counters["scale_downs"] += len(removed)
        for worker in removed:
            ray.kill(worker, no_restart=True)

    def _record(self, result: RewardResult) -> None:
        with self._lock:
            self.counters["calls"] += 1
            if result.reason != "ok":
                self.counters[f"failures/{result.reason}"] += 1
            self._wall_total += result.wall_s
            self._wall_max = max(self._wall_max, result.wall_s)

    def reward_fn(self):
        """``(item, response) -> float`` for ``PromptSource.reward`` (reasons stay in metrics; a
        response past its deadline raises ``RewardDeadline``, an ``error:`` result ``RewardRaised``
        with its error's text: the scheduler counts both)."""

        def fn(item, response: str) -> float:
            result = self.score(item, response)
            if result.reason == DEADLINE:
                raise RewardDeadline(f"reward worker: {result.wall_s:.1f}s")
            if result.reason.startswith("error:"):
                raise RewardRaised(result.error or result.reason[len("error:") :])
            return result.reward

        return fn

    def metrics(self) -> dict[str, float]:
        """Pool counters, call wall times, and each worker's scorer metrics (summed counts,
        max of everything else, e.g. the adaptive timeout's running T)."""
        with self._lock:
            out = {f"reward/{k}": float(v) for k, v in self.counters.items()}
            out["faults/reward"] = float(self.faults)
            calls = self.counters["calls"]
            out["reward/wall_s/mean"] = self._wall_total / calls if calls else 0.0
            out["reward/wall_s/max"] = self._wall_max
            out["reward/workers"], out["reward/queue"] = float(len(self._workers)), float(self._queued)
            workers = list(self._workers)
        for m in self._worker_metrics(workers):
            for key, value in m.items():
                summed = key.startswith(("sandbox/status/", "sandbox/leaked", "reward/stuck", "reward/cpu_s"))
                out[key] = out.get(key, 0.0) + value if summed else max(out.get(key, value), value)
        return out

    @staticmethod
    def _worker_metrics(workers: list) -> list[dict]:
        """Each live worker's metrics; a dead one is skipped (its next call replaces it)."""
        out = []
        for ref in [w.metrics.remote() for w in workers]:
            try:
                out.append(ray.get(ref, timeout=30))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                continue
        return out

    def close(self) -> None:
        with self._lock:  # under the lock: a scale-up that ends now sees the stop and kills its own
            self._stop.set()
            workers, self._workers = self._workers, []
        for worker in workers:
            ray.kill(worker, no_restart=True)


def pool_from_config(reward_cfg, plugins: tuple[str, ...] = (), max_restarts: int = 10) -> RewardPool | None:
    """The pool for a recipe's ``reward`` section, or None when ``reward.fn`` is empty (the task's
    own reward then runs in the scheduler's threads)."""
    if not reward_cfg.fn:
        return None
    return RewardPool(
        dict(reward_cfg.fn),
        num_workers=reward_cfg.num_workers,
        concurrency=reward_cfg.concurrency,
        timeout_s=reward_cfg.timeout_s,
        plugins=tuple(plugins),
        max_stuck=reward_cfg.max_stuck,
        max_restarts=max_restarts,
        autoscale=autoscale_config(reward_cfg),
        allow_unisolated=reward_cfg.sandbox.allow_unisolated,
        response_deadline_s=reward_cfg.response_deadline_s,
    )


def autoscale_config(reward_cfg) -> AutoscaleConfig | None:
    """``reward.max_workers > 0`` turns autoscaling on (``reward.min_workers`` .. ``max_workers``)."""
    if not reward_cfg.max_workers:
        return None
    return AutoscaleConfig(
        min_workers=reward_cfg.min_workers or 1,
        max_workers=reward_cfg.max_workers,
        scale_up_queue=reward_cfg.scale_up_queue,
        scale_down_idle_s=reward_cfg.scale_down_idle_s,
    )
