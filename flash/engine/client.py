"""Engine faults: a rollout engine that dies or hangs costs seconds, not the run.

``EngineClient`` stands between the driver's threads (scheduler collector and admission,
controller) and the engine actor. Every engine call goes through it; a call that fails because the
actor died (``RayActorError``: the process was killed, crashed, ran out of memory), because its
generation thread died (``EngineLoopError``), or because it did not answer within
``rollout.hang_timeout_s`` (a hung process: treated as dead and killed) starts one recovery:

1. count the fault (``faults/engine``) and log it once (later ones are counted, not logged);
2. kill the actor if it is still there (hung / broken thread); Ray restarts it (the actor was
   created with ``max_restarts = rollout.max_engine_restarts``) from the same model path;
3. wait until the new incarnation answers;
4. load the weights and version last pushed by the controller (the object ref is kept for this),
   so tokens from the new engine carry the right version (invariant 1);
5. ask the scheduler to resubmit every request of a pending prompt whose output had not been
   taken yet (``RolloutScheduler.requeue_lost``): same prompt ids, same request seeds; with
   environment episodes, every LLM turn an episode still waits for (``EpisodeScheduler.
   requeue_lost``): same context, same seed, the environments untouched.

With several replicas behind a router the same happens to the one replica that failed, while the
others serve on (``EngineClient`` below).

Callers that raced with the fault see the recovery's new ``epoch`` and retry their call (the
controller retries its whole suspend → push → resume sequence); only one recovery runs per fault.
After ``max_engine_restarts`` recoveries the next fault raises ``EngineFailed`` naming the knob, at
once: nothing is killed or restarted first. So with ``max_restarts=0`` the client is a
pass-through (the first fault stops the caller), and every caller talks to the engine through one
even when faults are not recovered: there is no second, unsupervised path to keep in step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from flash.engine.loop import EngineLoopError
from flash.engine.router import ReplicaError
from flash.errors import FlashError

log = logging.getLogger("flash")


class EngineFailed(FlashError):
    """The engine kept failing after every restart it was allowed."""


class EngineFault(RuntimeError):
    """An engine-side failure that a caller wrapped (e.g. a model-update push to the engine failed,
    with the trainer alive): recovered like a dead engine -- restart, then the caller retries."""


def is_engine_fault(exc: BaseException, engine_id: str | None = None) -> bool:
    """A failure that a restart can cure: the actor or its generation thread is gone, or it hung.

    A ``RayActorError`` that names another actor is not one: the trainer dying while the engine
    waits for its weights surfaces in the engine call, and must stop the run, not restart engines.
    """
    if isinstance(exc, ReplicaError):  # a replica behind the router (the router itself is alive)
        return True
    if isinstance(exc, RayActorError):
        other = getattr(exc, "actor_id", None)
        return not (other and engine_id and other != engine_id)
    return isinstance(exc, (GetTimeoutError, EngineLoopError, EngineFault))


class EngineClient:
    """One engine, or several replicas behind a ``Router`` (``replicas`` and ``router`` given).

    With a router every fault names its replica (``ReplicaError``); recovery is per replica: it is
    taken out of service (``Router.replica_down`` hands back the ids it held), restarted, given
    the weights and version last pushed, brought back (``replica_up``), and only its requests are
    resubmitted (``requeue(ids)``, spread by load over the replicas); the others serve on. Each
    replica has its own epoch; ``epoch`` (their sum) tells the controller to form the model-update
    group again after any restart.

    Every engine call of a run goes through one (the runner builds it with the engines); the names
    the schedulers and the controller use are ``submit``, ``poll``, ``call``, ``run`` and ``epoch``,
    with the ``requeue`` and ``on_event`` hooks. ``passthrough`` is one that recovers nothing.
    """

    def __init__(
        self,
        engine,
        hang_timeout_s: float | None,
        max_restarts: int,
        warn: Callable[[str], None] = log.warning,
        start_timeout_s: float = 300.0,
        replicas: list | None = None,
    ):
        self.engine = engine  # the engine, or the Router in front of ``replicas``
        self.router = engine if replicas else None
        self.replicas = list(replicas) if replicas else [engine]
        self.engine_id = engine._actor_id.hex() if hasattr(engine, "_actor_id") else None
        self.hang_timeout_s = hang_timeout_s
        self.max_restarts = max_restarts
        self.start_timeout_s = start_timeout_s
        self.epochs = [0] * len(self.replicas)  # recoveries completed, per replica
        self.faults = 0  # every fault of the run (restored on resume): faults/engine
        self.restarts = 0  # recoveries by this process: bounded by max_restarts (Ray's budget)
        self.events: list[dict[str, Any]] = []  # one per fault, for events.jsonl and benchmarks
        self.requeue: Callable[..., int] | None = None  # the scheduler's requeue_lost
        self.on_event: Callable[[dict], None] | None = None  # each fault, as soon as recovered
        self._warn = warn
        self._lock = threading.RLock()  # a fault inside a recovery (requeue's submit) recovers again
        self._weights_lock = threading.RLock()  # a weight update vs a restarted replica's weight load
        self._hung: set[int] = set()  # replicas killed for hanging, not yet recovered
        self._recovering: dict[int, int] = {}  # replica -> outputs collected meanwhile (background recovery)
        self._async_error: BaseException | None = None
        self._rec_lock = threading.Lock()
        self._weights = None  # object ref of the weights last pushed, and their version
        self._version = 0

    @classmethod
    def passthrough(cls, engine) -> EngineClient:
        """No recovery and no hang timeout: each call is ``ray.get`` of the engine's method, and a
        fault raises (``EngineFailed``, from the engine's error) -- for callers that run without
        the runner's fault handling (unit tests, tools)."""
        return cls(engine, hang_timeout_s=None, max_restarts=0)

    @property
    def epoch(self) -> int:
        return sum(self.epochs)

    # ---- calls -----------------------------------------------------------------------------
    def call(self, name: str, *args, timeout: float | None = None):
        """``ray.get(engine.name.remote(*args))``, recovering from engine faults and retrying."""
        return self.run(lambda: ray.get(getattr(self.engine, name).remote(*args), timeout=timeout))

    def run(self, fn: Callable[[], Any], exclusive: bool = False):
        """Run ``fn`` (engine calls); on an engine fault recover, then run all of ``fn`` again.
        ``exclusive``: no recovery's weight load overlaps ``fn`` (the controller's weight update:
        a restarted replica gets the weights of the last *completed* push, never older weights
        over newer ones). The rest of a recovery (waiting for the new process) may overlap it: the
        update goes on with the replicas in service."""
        while True:
            epochs = list(self.epochs)
            try:
                if not exclusive:
                    return fn()
                with self._weights_lock:
                    return fn()
            except Exception as exc:
                if not is_engine_fault(exc, self.engine_id):
                    raise
                self.recover(epochs, exc)

    def poll(self, timeout: float) -> list:
        """The collector's ``get_finished``; no answer within the hang timeout counts as a hang
        (a router watches each replica's poll itself, and answers within ``timeout`` + 5 s).

        Behind a router a failed replica is recovered in a background thread, so the collector
        goes on taking the live replicas' outputs meanwhile (counted in the fault's event as
        ``outputs_meanwhile``); a recovery that fails stops the run at the next poll."""
        if self.router is None:
            return self.call("get_finished", timeout, timeout=self._within(timeout))
        if self._async_error is not None:
            raise self._async_error
        epochs = list(self.epochs)
        try:
            outs = ray.get(self.engine.get_finished.remote(timeout), timeout=self._within(timeout + 30.0))
        except Exception as exc:
            if not is_engine_fault(exc, self.engine_id):
                raise
            i = self._replica(exc)
            if i < 0 or self._exhausted():  # nothing to restart: raise here, not at the next poll
                self.recover(epochs, exc)
            elif self._start_recovering(i):
                threading.Thread(
                    target=self._recover_in_background, args=(i, epochs, exc), daemon=True, name=f"recover-replica{i}"
                ).start()
            return []
        with self._rec_lock:
            for i in self._recovering:
                self._recovering[i] += len(outs)
        return outs

    def _within(self, seconds: float) -> float | None:
        """The ``ray.get`` timeout of a call that should answer in ``seconds``: past it by the hang
        timeout, the engine is hung (None: no hang timeout, wait as long as it takes)."""
        return None if self.hang_timeout_s is None else seconds + self.hang_timeout_s

    def _exhausted(self) -> bool:
        return self.restarts >= self.max_restarts

    def _start_recovering(self, i: int) -> bool:
        with self._rec_lock:
            if i in self._recovering:
                return False
            self._recovering[i] = 0
            return True

    def _recover_in_background(self, i: int, epochs: list[int], exc: BaseException) -> None:
        try:
            self.recover(epochs, exc)
        except BaseException as err:  # noqa: BLE001 - raised in the collector by the next poll
            self._async_error = err
        finally:
            with self._rec_lock:
                self._recovering.pop(i, None)

    def submit(self, reqs: list) -> None:
        """Submit; a fault here needs no retry: the recovery resubmits what is pending (a router
        keeps a failed replica's requests outstanding on it, and hands them back at recovery)."""
        while True:
            epochs = list(self.epochs)
            try:
                ray.get(self.engine.submit.remote(reqs), timeout=self._within(0.0))
                return
            except Exception as exc:
                if not is_engine_fault(exc, self.engine_id):
                    raise
                if self._replica(exc) >= 0:
                    self.recover(epochs, exc)
                    return
                with self._lock:  # no replica in service: wait out the recoveries, submit again
                    pass

    def pushed(self, weights, version: int) -> None:
        """The controller pushed ``weights`` as ``version``: what a restarted engine gets. ``weights``
        is an object ref, or a callable returning one, called only at a restart (the model-update
        group keeps no copy in the object store: ``trainer.get_weights.remote``). A restart between
        a train step and the push that follows it then loads the just-trained weights under the
        previous version, until that push relabels them: token versions are never newer than the
        weights that produced them, so the staleness bound still holds."""
        self._weights, self._version = weights, version

    # ---- recovery --------------------------------------------------------------------------
    def _replica(self, exc: BaseException) -> int:
        """The replica a fault names: 0 for the single engine; -1 if a router's fault names none."""
        if self.router is None:
            return 0
        replica = getattr(exc, "replica", -1) if isinstance(exc, ReplicaError) else -1
        return replica if 0 <= replica < len(self.replicas) else -1

    def recover(self, epochs: list[int], exc: BaseException) -> None:
        """Restart the failed replica and requeue its work, unless another caller already did
        (its epoch moved since ``epochs`` was read)."""
        i = self._replica(exc)
        if i < 0:
            return self._recover_unnamed(epochs, exc)
        kind = self._kind(exc)
        if self._exhausted() and self.epochs[i] == epochs[i]:
            self._give_up(i, kind, exc)  # no restart left: raise now, nothing killed first
        if kind == "hung" and self.epochs[i] == epochs[i]:
            # killed before taking the lock: a weight update holding it may be blocked on this replica
            self._hung.add(i)
            ray.kill(self.replicas[i], no_restart=False)  # Ray restarts it (max_restarts)
        with self._lock:
            if self.epochs[i] != epochs[i]:
                return
            if i in self._hung:
                kind = "hung"
            elif kind == "broken" and not isinstance(exc, ReplicaError):
                kind = self._probe(i)
            self._recover(i, kind, exc)

    def _recover_unnamed(self, epochs: list[int], exc: BaseException) -> None:
        """A fault behind the router that names no replica (a model-update push failed, the router
        did not answer): done once another caller recovered a replica meanwhile (a dead replica's
        poll fails in the collector within seconds); else the replica that does not answer
        ``health`` is recovered; none within ``hang_timeout_s``: ``EngineFailed``."""
        hang = self.hang_timeout_s if self.hang_timeout_s is not None else self.start_timeout_s
        deadline = time.monotonic() + hang
        while time.monotonic() < deadline:
            with self._lock:
                if self.epochs != epochs:
                    return
                for i, replica in enumerate(self.replicas):
                    try:
                        ray.get(replica.health.remote(), timeout=min(10.0, hang))
                    except (RayActorError, GetTimeoutError) as err:
                        return self.recover(epochs, ReplicaError(f"engine replica {i}: {err!r}", i, self._kind(err)))
            time.sleep(1.0)
        raise EngineFailed(f"rollout engine fault ({exc!r}) and every replica answers; stopping") from exc

    def _kind(self, exc: BaseException) -> str:
        if isinstance(exc, ReplicaError):
            return getattr(exc, "kind", "broken")
        if isinstance(exc, GetTimeoutError):
            return "hung"
        return "died" if isinstance(exc, RayActorError) else "broken"

    def _probe(self, i: int) -> str:
        """A fault that names no kind itself (a failed weight push wrapped as ``EngineFault``):
        ``died`` if replica ``i``'s actor is gone, else ``broken`` (it answers ``health``, with an
        error or not, or does not answer within 30 s: either way it is killed and restarted)."""
        try:
            ray.get(self.replicas[i].health.remote(), timeout=30.0)
        except RayActorError:
            return "died"
        except Exception:  # noqa: BLE001 - alive but failing, or silent: restarted as broken
            return "broken"
        return "broken"

    def _what(self, i: int) -> str:
        return "rollout engine" if self.router is None else f"rollout engine replica {i}"

    def _give_up(self, i: int, kind: str, exc: BaseException) -> None:
        """Count the fault and raise ``EngineFailed`` naming the knob: no restart is left."""
        with self._lock:
            self.faults += 1
            self.restarts += 1
        raise EngineFailed(
            f"{self._what(i)} {kind} again after {self.max_restarts} restarts "
            f"(rollout.max_engine_restarts={self.max_restarts}); last error: {exc!r}. Raise "
            f"rollout.max_engine_restarts, or look for what kills it (memory, a bad request)"
        ) from exc

    def _recover(self, i: int, kind: str, exc: BaseException) -> None:
        if self._exhausted():  # the budget went to a recovery that raced with this one
            self._give_up(i, kind, exc)
        start, wall = time.monotonic(), time.time()
        self.faults += 1
        self.restarts += 1
        what = self._what(i)
        if self.restarts == 1:
            self._warn(
                f"flash: {what} {kind} ({type(exc).__name__}); restarting it and requeueing its "
                f"requests (faults counted in faults/engine, logged once)"
            )
        lost = ray.get(self.router.replica_down.remote(i)) if self.router is not None else None
        replica = self.replicas[i]
        if kind == "broken":
            ray.kill(replica, no_restart=False)  # Ray restarts it (max_restarts)
        self._wait_alive(replica, exc)
        with self._weights_lock:  # the weights of the last completed push, then back in service
            if self._weights is not None:
                weights = self._weights if isinstance(self._weights, ray.ObjectRef) else self._weights()
                ray.get(replica.pause.remote("continue"))
                ray.get(replica.update_weights.remote(weights, self._version))
                ray.get(replica.resume.remote())
            if self.router is not None:
                ray.get(self.router.replica_up.remote(i))
        self._hung.discard(i)
        requeued = 0
        if self.requeue is not None:
            requeued = self.requeue() if lost is None else self.requeue(lost)
        self.epochs[i] += 1
        event = {
            "event": "engine_fault",
            "kind": kind,
            "error": type(exc).__name__,
            "time": wall,
            "recovery_s": time.monotonic() - start,
            "requeued": requeued,
            "version": self._version,
            "replica": i,
            "pid": ray.get(replica.pid.remote()),
        }
        if self.router is not None:
            with self._rec_lock:
                event["outputs_meanwhile"] = self._recovering.get(i, 0)  # the live replicas served on
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)

    def _wait_alive(self, replica, exc: BaseException) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            try:
                ray.get(replica.health.remote(), timeout=max(1.0, deadline - time.monotonic()))
                return
            except (RayActorError, GetTimeoutError) as err:
                if time.monotonic() >= deadline:
                    raise EngineFailed(
                        f"rollout engine did not come back within {self.start_timeout_s:.0f}s "
                        f"after it failed ({exc!r}); last error: {err!r}"
                    ) from err
                time.sleep(0.2)

    def metrics(self) -> dict[str, float]:
        m = {"faults/engine": float(self.faults)}
        if self.events:
            m["faults/engine_recovery_s"] = self.events[-1]["recovery_s"]
        return m
