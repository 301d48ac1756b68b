"""Several engine replicas behind one engine handle: load-based routing and prompt affinity.

The scheduler and the controller talk to *an engine* (the protocols of ``flash.engine.base``:
``Rollout``, ``Control``, ``Ops``, ``Lifecycle``). ``Router`` is a Ray actor that satisfies them, so
neither of them changes when ``placement.roles.actor_infer.num_workers`` grows past one:

- ``submit`` sends each request to the replica with the least outstanding work
  (``LoadBalancer``); with ``prompt_affinity`` the requests of one prompt (its GRPO group) go to
  one replica, chosen by load when the prompt first arrives and kept while any of them is out.
- ``get_finished`` keeps one poll in flight per replica and returns whatever is ready as soon as
  any replica answers, so a busy replica never delays another's outputs; an unanswered poll stays
  in flight for the next call, so no output is ever dropped.
- ``abort`` goes to the replicas that own the requests; ``pause``, ``resume``, ``sleep``,
  ``wake_up`` and ``update_weights`` go to every replica and return only when all are done, so a version
  advances only once every replica holds the new weights.

A replica that dies surfaces as ``ReplicaError`` naming it (and whether it ``died``, ``hung`` or
broke), on the next call that touches it; one whose poll stays unanswered for ``hang_timeout_s``
past its own timeout is ``hung``. Recovery (``flash.engine.client.EngineClient``) takes it out of
service (``replica_down``: no requests, polls or fan-outs reach it; the ids it held are returned to
be resubmitted), restarts it, gives it the current weights, and brings it back (``replica_up``);
the live replicas serve on meanwhile.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import ray

from flash.engine.base import GenerationOutput, GenerationRequest


class ReplicaError(RuntimeError):
    """An engine replica failed (its actor died, hung or raised); the message names its index,
    ``kind`` says how: ``died``, ``hung`` or ``broken`` (e.g. its generation thread died)."""

    def __init__(self, message: str, replica: int = -1, kind: str = "broken"):
        super().__init__(message)
        self.replica, self.kind = replica, kind

    def __reduce__(self):  # across Ray: the index and kind travel with the message
        return (ReplicaError, (str(self), self.replica, self.kind))


def failure_kind(exc: BaseException) -> str:
    if isinstance(exc, ray.exceptions.RayActorError):
        return "died"
    return "hung" if isinstance(exc, ray.exceptions.GetTimeoutError) else "broken"


@dataclass
class _Out:
    replica: int
    cost: int
    key: tuple | None


class LoadBalancer:
    """Which replica serves each request: pure bookkeeping, no Ray (unit-tested on its own).

    A request's *cost* is ``len(prompt) + max_new_tokens``, the tokens it may occupy; a replica's
    *load* is the summed cost of its outstanding requests. A request goes to the replica with the
    least load (then fewest requests, then lowest index). Under affinity the unit is a prompt
    (equal prompt token ids): a new prompt's requests go together to the least-loaded replica, and
    later requests of a prompt still outstanding follow them there.
    """

    def __init__(self, replicas: int, affinity: bool = False):
        if replicas < 1:
            raise ValueError(f"need at least one replica, got {replicas}")
        self.affinity = affinity
        self.load = [0] * replicas
        self.count = [0] * replicas
        self.routed = [0] * replicas  # requests ever sent to each replica
        self.down: set[int] = set()  # replicas out of service (being restarted)
        self._out: dict[str, _Out] = {}
        self._pinned: dict[tuple, list[int]] = {}  # prompt key -> [replica, outstanding requests]

    def _least_loaded(self) -> int:
        live = [i for i in range(len(self.load)) if i not in self.down]
        if not live:
            raise ReplicaError("no engine replica is in service (all are being restarted)")
        return min(live, key=lambda i: (self.load[i], self.count[i], i))

    def outstanding_on(self, replica: int) -> list[str]:
        return [rid for rid, out in self._out.items() if out.replica == replica]

    def assign(self, requests: list[GenerationRequest]) -> list[int]:
        """Route ``requests`` (recorded as outstanding) to replicas in service (not in ``down``);
        returns each one's replica index."""
        ids = [r.request_id for r in requests]
        dup = next((i for i in ids if i in self._out), None) or next((i for i in ids if ids.count(i) > 1), None)
        if dup is not None:
            raise ValueError(f"request {dup!r} is already in flight; request ids must be unique")
        if not self.affinity:
            return [self._add(r, self._least_loaded(), None) for r in requests]
        groups: dict[tuple, list[GenerationRequest]] = {}
        for r in requests:
            groups.setdefault(tuple(r.prompt_ids), []).append(r)
        chosen = {}
        for key, members in groups.items():
            pin = self._pinned.get(key)
            chosen[key] = pin[0] if pin else self._least_loaded()
            for r in members:
                self._add(r, chosen[key], key)
        return [chosen[tuple(r.prompt_ids)] for r in requests]

    def _add(self, r: GenerationRequest, i: int, key: tuple | None) -> int:
        cost = len(r.prompt_ids) + r.params.max_new_tokens
        self._out[r.request_id] = _Out(i, cost, key)
        self.load[i] += cost
        self.count[i] += 1
        self.routed[i] += 1
        if key is not None:
            self._pinned.setdefault(key, [i, 0])[1] += 1
        return i

    def owner(self, request_id: str) -> int | None:
        out = self._out.get(request_id)
        return None if out is None else out.replica

    def done(self, request_ids: list[str]) -> None:
        """These requests left their replica (finished, refused or aborted); unknown ids are ignored."""
        for rid in request_ids:
            out = self._out.pop(rid, None)
            if out is None:
                continue
            self.load[out.replica] -= out.cost
            self.count[out.replica] -= 1
            if out.key is not None:
                pin = self._pinned[out.key]
                pin[1] -= 1
                if pin[1] == 0:
                    del self._pinned[out.key]

    @property
    def outstanding(self) -> int:
        return len(self._out)


def merge_spans(spans: list[list[float]]) -> list[list[float]]:
    """The union of possibly overlapping ``[start, end]`` spans, sorted: busy if *any* replica is."""
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


class Router:
    """A Ray actor (threaded) in front of engine replica actors; see the module docstring."""

    def __init__(self, replicas: list, prompt_affinity: bool = False, hang_timeout_s: float | None = None):
        self.replicas = list(replicas)
        self.hang_timeout_s = hang_timeout_s  # None: a silent replica is never called hung
        self.balancer = LoadBalancer(len(self.replicas), prompt_affinity)
        self._lock = threading.Lock()  # the balancer
        self._poll_lock = threading.Lock()  # the in-flight polls (one collector at a time)
        self._polls: dict[int, ray.ObjectRef] = {}
        self._poll_since: dict[int, float] = {}  # when each in-flight poll was sent
        self._carry: list[GenerationOutput] = []  # outputs taken while another replica failed

    def _get(self, refs: dict, what: str) -> list:
        """``ray.get`` of calls keyed by replica index (in key order), naming a replica that failed."""
        out = []
        for i, ref in sorted(refs.items()):
            try:
                out.append(ray.get(ref))
            except Exception as exc:
                self._quarantine(i)
                raise ReplicaError(f"engine replica {i} failed in {what}: {exc!r}", i, failure_kind(exc)) from exc
        return out

    def _quarantine(self, replica: int) -> None:
        """With fault recovery on (``hang_timeout_s`` set), a replica that failed is out of service
        at once: no request is routed to it (a restarted process would serve it with its initial
        weights) until the recovery brings it back (``replica_up``)."""
        if self.hang_timeout_s is not None:
            with self._lock:
                self.balancer.down.add(replica)

    def _live(self) -> list[int]:
        with self._lock:
            return [i for i in range(len(self.replicas)) if i not in self.balancer.down]

    def _all(self, method: str, *args) -> list:
        """``method`` on every replica in service (in index order)."""
        return self._get({i: getattr(self.replicas[i], method).remote(*args) for i in self._live()}, method)

    # ---- recovery (flash.engine.client) ---------------------------------------------------------------
    def replica_down(self, replica: int) -> list[str]:
        """Take ``replica`` out of service; returns the ids of the requests it held (now not
        outstanding anywhere: the caller resubmits them)."""
        with self._poll_lock, self._lock:
            self.balancer.down.add(replica)
            self._polls.pop(replica, None)
            self._poll_since.pop(replica, None)
            lost = self.balancer.outstanding_on(replica)
            self.balancer.done(lost)
        return lost

    def replica_up(self, replica: int) -> None:
        with self._lock:
            self.balancer.down.discard(replica)

    # ---- requests ------------------------------------------------------------------------------
    def submit(self, requests: list[GenerationRequest]) -> int:
        with self._lock:
            where = self.balancer.assign(list(requests))
        per: dict[int, list[GenerationRequest]] = {}
        for r, i in zip(requests, where):
            per.setdefault(i, []).append(r)
        # a replica that fails here keeps its requests outstanding: replica_down hands them back
        self._get({i: self.replicas[i].submit.remote(rs) for i, rs in per.items()}, "submit")
        return len(requests)

    def routes(self, request_ids: list[str]) -> list[int | None]:
        """The replica serving each request, None once it has left (for tests and debugging)."""
        with self._lock:
            return [self.balancer.owner(r) for r in request_ids]

    def get_finished(self, timeout: float) -> list[GenerationOutput]:
        """Outputs from any replica; waits up to ``timeout`` s for the first one."""
        with self._poll_lock:
            for i in self._live():
                if i not in self._polls:
                    self._polls[i] = self.replicas[i].get_finished.remote(timeout)
                    self._poll_since[i] = time.monotonic()
            by_ref = {ref: i for i, ref in self._polls.items()}
            ready, _ = ray.wait(list(by_ref), num_returns=1, timeout=timeout + 5.0)
            ready, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=0) if ready else ([], [])
            outs, self._carry = self._carry, []
            failed = None
            for ref in ready:
                i = by_ref[ref]
                del self._polls[i]
                try:
                    outs += self._get({i: ref}, "get_finished")[0]
                except ReplicaError as exc:
                    failed = exc
            failed = failed or self._hung(timeout)
            with self._lock:
                self.balancer.done([o.request_id for o in outs])
            if failed is not None:  # the healthy replicas' outputs wait for the next call
                self._carry = outs
                raise failed
        return outs

    def _hung(self, timeout: float) -> ReplicaError | None:
        """A replica whose poll is unanswered ``hang_timeout_s`` past its own ``timeout`` (under the
        poll lock); its poll is dropped, so the error is raised once."""
        if self.hang_timeout_s is None:
            return None
        now = time.monotonic()
        for i, since in list(self._poll_since.items()):
            if i in self._polls and now - since > timeout + self.hang_timeout_s:
                del self._polls[i], self._poll_since[i]
                self._quarantine(i)
                return ReplicaError(
                    f"engine replica {i} failed in get_finished: no answer for {now - since:.0f} s "
                    f"(rollout.hang_timeout_s={self.hang_timeout_s:g})",
                    i,
                    "hung",
                )
        return None

    def abort(self, request_ids: list[str] | None = None) -> list[GenerationOutput]:
        """Abort on the owning replicas (None = everything everywhere); partial outputs returned."""
        if request_ids is None:
            outs = [o for part in self._all("abort", None) for o in part]
        else:
            with self._lock:
                owners = {rid: self.balancer.owner(rid) for rid in request_ids}
            per: dict[int, list[str]] = {}
            for rid, i in owners.items():
                if i is not None:
                    per.setdefault(i, []).append(rid)
            parts = self._get({i: self.replicas[i].abort.remote(ids) for i, ids in per.items()}, "abort")
            outs = [o for part in parts for o in part]
        with self._lock:
            self.balancer.done([o.request_id for o in outs])
        return outs

    # ---- fan-out -------------------------------------------------------------------------------
    def pause(self, mode: str) -> None:
        self._all("pause", mode)

    def resume(self) -> None:
        self._all("resume")

    def sleep(self, level: int = 1) -> dict:
        """Every replica releases its memory (``TorchEngine.sleep``); what each released is under
        ``replicas`` (in index order): one dict, as from a single engine (``Ops.sleep``)."""
        return {"level": level, "replicas": self._all("sleep", level)}

    def wake_up(self) -> dict:
        return {"replicas": self._all("wake_up")}

    def update_weights(self, named_tensors, version: int) -> float:
        """Every replica loads the weights (one object-store copy, read by all); bytes summed."""
        ref = ray.put(named_tensors)
        return float(sum(self._all("update_weights", ref, version)))

    def version(self) -> int:
        """The version every replica in service has reached (the smallest)."""
        return min(int(v) for v in self._all("version"))

    def health(self) -> bool:
        return all(self._all("health"))

    def stats(self) -> dict[str, float]:
        """Replica stats combined: counts summed, busy/idle seconds averaged (so the controller's
        idle ratio is the pool's mean), version the smallest; plus per-replica routing figures."""
        parts = self._all("stats")
        n = len(parts)
        out = {
            k: float(sum(p.get(k, 0.0) for p in parts))
            for k in ("tokens_generated", "num_running", "num_waiting", "decode_steps", "cpu_s")
        }
        out.update({k: sum(p.get(k, 0.0) for p in parts) / n for k in ("busy_s", "idle_s")})
        out["version"] = float(min(p.get("version", 0.0) for p in parts))
        out["replicas"] = float(n)  # in service
        with self._lock:
            for i in range(len(self.replicas)):
                out[f"replica{i}/outstanding"] = float(self.balancer.count[i])
                out[f"replica{i}/routed"] = float(self.balancer.routed[i])
        return out

    def busy_spans(self) -> list[list[float]]:
        return merge_spans([s for part in self._all("busy_spans") for s in part])

    def pid(self) -> int:
        """The router's own process id (``Lifecycle``; a replica's is asked of the replica)."""
        return os.getpid()

    def shutdown(self) -> None:
        self._all("shutdown")


def start_router(replicas: list, prompt_affinity: bool = False, hang_timeout_s: float | None = None):
    """The ``Router`` actor over ``replicas`` (engine actor handles); threaded like an engine."""
    actor = ray.remote(Router).options(num_cpus=0, max_concurrency=16)
    return actor.remote(replicas, prompt_affinity, hang_timeout_s)
