"""The model-update group on Ray: actor mixins for its members and the controller's handle.

``UpdateSender`` (the trainer actor, rank 0) and ``UpdateReceiver`` (each engine actor, ranks 1..N)
add ``mu_*`` methods to their host actor; the host supplies only what differs between roles:
the trainer its full state dict (``_mu_state``), an engine its parameter shapes (``_mu_shapes``) and
how to load ``(name, tensor)`` pairs in place under a version (``_mu_apply``).

``ModelUpdateGroup`` is what the controller holds: ``setup()`` once (rendezvous), then
``push(version)`` inside its suspend → push → resume phase. Every failure is a named
``ModelUpdateError`` (which member, what) and counted in ``counters``; after a failure inside a
collective the group is *broken* (its members may be mid-broadcast) and refuses further pushes
instead of hanging in them.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from flash.weights.model_update import (
    BACKENDS,
    ModelUpdateError,
    TensorMeta,
    _Buffers,
    agreed_dtypes,
    bucket_sizes,
    check_plan,
    connect,
    dtype_name,
    make_group,
    open_store,
    plan_state,
    receive,
    redundant_names,
    send,
)
from flash.weights.cuda_ipc import IpcReceiver, IpcSender
from flash.weights.shm import ShmSender, read

COLOCATED = ("shm", "cuda_ipc")  # the sender writes one flat buffer, then the replicas read it


def choose_backend(requested: str, where: list[dict[str, str]]) -> str:
    """The backend for members at ``where`` (``{"node", "device"}`` each; the trainer first).

    ``auto``: every member on one GPU → ``cuda_ipc`` (colocated: the replicas read the trainer's
    buffer in place, no byte leaves the GPU); every member on one node and some of them sharing a
    device (CPU, or a GPU that a trainer rank and one of several replicas share) → ``shm`` (no copy
    across processes; NCCL cannot join two members on one GPU); GPUs otherwise → ``nccl``; else
    ``gloo``. An explicit choice that cannot work is an error naming the fix.
    """
    if requested not in BACKENDS:
        raise ModelUpdateError(f"model_update.backend {requested!r} is not one of {', '.join(BACKENDS)}")
    nodes = {w["node"] for w in where}
    devices = {w["device"] for w in where}
    cuda = any(d.startswith("cuda") for d in devices)
    one_gpu = cuda and len(nodes) == 1 and len(devices) == 1
    if requested == "auto":
        if one_gpu:
            return "cuda_ipc"
        if len(nodes) == 1 and len(devices) < len(where):
            return "shm"
        return "nccl" if cuda else "gloo"
    if requested == "nccl" and not all(d.startswith("cuda") for d in devices):
        raise ModelUpdateError(
            f"model_update.backend=nccl needs every member on a GPU; members are on {sorted(devices)}: use gloo"
        )
    if requested == "nccl" and len(devices) < len(where):
        raise ModelUpdateError(
            "model_update.backend=nccl cannot join two members on one GPU (colocated): use shm or auto"
        )
    if requested == "cuda_ipc" and not one_gpu:
        raise ModelUpdateError(
            "model_update.backend=cuda_ipc needs every member on one GPU of one node; "
            f"members are on {sorted(devices)}: use shm, nccl or auto"
        )
    if requested == "shm" and len(nodes) > 1:
        raise ModelUpdateError("model_update.backend=shm needs every member on one node; use gloo or nccl")
    return requested


def gathers_on_device(backend: str) -> bool:
    """Whether a sharded trainer gathers the full weights for a push onto its rank 0's device
    (``cuda_ipc``: they go from there into the shared CUDA buffer, no byte through host memory)
    rather than into host memory (the other backends: NCCL broadcasts bucket by bucket from host
    tensors, so rank 0's GPU never holds a second full copy of the model beside its training state)."""
    return backend == "cuda_ipc"


def _transport_device(backend: str) -> torch.device:
    """Where a member's bucket buffers live: this process's GPU for NCCL, else host memory."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _where(device: torch.device) -> dict[str, str]:
    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
    if device.type == "cuda":
        return {"node": node, "device": f"cuda:{torch.cuda.get_device_properties(device).uuid}"}
    return {"node": node, "device": "cpu"}


@dataclass
class _Member:
    """One actor's side of one group (an actor may be in several, e.g. a trainer feeding two pools)."""

    backend: str
    pg: Any = None
    store: Any = None
    buffers: _Buffers | None = None
    shm: ShmSender | None = None
    ipc: IpcSender | IpcReceiver | None = None
    metas: list[TensorMeta] = field(default_factory=list)
    skip: set[str] = field(default_factory=set)  # aliases tied in the receiver's own model too


def _groups(actor) -> dict[str, _Member]:
    if not hasattr(actor, "_mu_groups"):
        actor._mu_groups = {}
    return actor._mu_groups


def _member(actor, group: str) -> _Member:
    try:
        return _groups(actor)[group]
    except KeyError:
        raise ModelUpdateError(f"this actor is not in model-update group {group!r}; call setup() first") from None


class UpdateSender:
    """Mixin for the trainer actor. The host defines ``_mu_state() -> {name: tensor}`` (full weights)."""

    def _mu_device(self) -> torch.device:
        return next(iter(self._mu_state().values())).device

    def mu_where(self) -> dict[str, str]:
        return _where(self._mu_device())

    def mu_open(self, group: str, backend: str, host: str, timeout_s: float) -> int:
        """Start the group's rendezvous store (this member is rank 0); returns its port."""
        m = _groups(self)[group] = _Member(backend)
        m.store = open_store(host, timeout_s)
        return int(m.store.port)

    def mu_join(self, group: str, world: int, timeout_s: float) -> None:
        m = _member(self, group)
        if m.backend == "shm":
            m.shm = ShmSender()
        elif m.backend == "cuda_ipc":
            m.ipc = IpcSender()
        else:
            m.pg = make_group(m.backend, m.store, group, 0, world, timeout_s)
            m.buffers = _Buffers(_transport_device(m.backend))

    def mu_plan(self, group: str, bucket_bytes: int, cast: dict[str, str] | None = None) -> list:
        """Plan this push (names, shapes, dtypes, buckets) as plain lists; kept for ``mu_send``.
        ``cast``: ``{name: dtype}`` to send a tensor in (the replicas'), else its own dtype."""
        m = _member(self, group)
        m.metas = plan_state(self._mu_state(), bucket_bytes, cast)
        return [meta.to_wire() for meta in m.metas]

    def mu_send(self, group: str) -> dict[str, Any]:
        """Broadcast (or, colocated, write) the planned tensors; returns the bytes and what the
        replicas read (``path``: the shm segment, ``handle``: the CUDA IPC buffer), if any."""
        m, start = _member(self, group), time.perf_counter()
        state = self._mu_state()
        path = handle = None
        with torch.no_grad():
            if m.shm is not None:
                path, nbytes = m.shm.write(state, m.metas)
            elif m.ipc is not None:
                handle = m.ipc.write(state, m.metas)
                nbytes = handle["bytes"]
            else:
                nbytes = send(m.pg, state, m.metas, m.buffers)
        return {"bytes": nbytes, "path": path, "handle": handle, "send_s": time.perf_counter() - start}

    def mu_close(self, group: str) -> None:
        _close(_groups(self).pop(group, None))


class UpdateReceiver:
    """Mixin for an engine actor. The host defines ``_mu_shapes() -> {name: shape}`` and
    ``_mu_apply(items, version)``, which copies each ``(name, tensor)`` of the iterator at once and
    sets its version last, and ``_mu_device()``, where its weights live (no default: a receiver
    that reported the CPU while its weights sit on a GPU would get the wrong backend); it may
    define ``_mu_ties()`` (groups of names sharing one storage in its model, loaded once; default
    none) and ``_mu_targets()`` (its live tensors, written directly by ``_mu_apply``'s iteration;
    default none)."""

    def _mu_device(self) -> torch.device:
        raise NotImplementedError(f"{type(self).__name__} must say where its weights live (_mu_device)")

    def _mu_ties(self) -> list[tuple[str, ...]]:
        return []

    def _mu_targets(self) -> dict[str, torch.Tensor] | None:
        """``{name: live tensor}`` that lone tensors may be received into directly; None: never."""
        return None  # noqa: RET501 - None is the meaningful answer here

    def mu_where(self) -> dict[str, str]:
        return _where(self._mu_device())

    def mu_members(self) -> int:
        """The group ranks this replica takes, from ``rank`` on (a tensor-parallel engine: one per rank)."""
        return 1

    def mu_join(self, group: str, backend: str, host: str, port: int, rank: int, world: int, timeout_s: float) -> None:
        m = _groups(self)[group] = _Member(backend)
        if backend == "cuda_ipc":
            m.ipc = IpcReceiver()
        elif backend != "shm":
            m.store = connect(host, port, timeout_s)
            m.pg = make_group(backend, m.store, group, rank, world, timeout_s)
            m.buffers = _Buffers(_transport_device(backend))

    def mu_dtypes(self) -> dict[str, str]:
        """``{name: dtype}`` of this engine's live tensors (none known: empty), for a push that
        casts at the sender (every backend but ``object_store``)."""
        targets = self._mu_targets()
        return {} if targets is None else {name: dtype_name(t.dtype) for name, t in targets.items()}

    def mu_check(self, group: str, wire: list) -> int:
        """Validate a plan against this engine's parameters before any byte moves; keep it."""
        metas = [TensorMeta.from_wire(item) for item in wire]
        check_plan(metas, self._mu_shapes())
        m = _member(self, group)
        m.metas, m.skip = metas, redundant_names(metas, self._mu_ties())
        return len(metas)

    def mu_receive(self, group: str, version: int, sent: dict[str, Any] | None = None) -> dict[str, float]:
        """Load the pushed weights in place and take ``version``; the ack is this method's return.
        ``sent``: the sender's ``mu_send`` result, for the colocated backends (what to read)."""
        m, start = _member(self, group), time.perf_counter()
        if m.backend == "shm":
            items = read(sent["path"], sent["bytes"], m.metas)
        elif m.backend == "cuda_ipc":
            items = m.ipc.read(sent["handle"], m.metas)
        else:
            items = receive(m.pg, m.metas, m.buffers, self._mu_targets())
        expected = sum(len(meta.names) for meta in m.metas) - len(m.skip)
        counted = _Counted((name, t) for name, t in items if name not in m.skip)
        with torch.no_grad():
            self._mu_apply(counted, version)
        if m.ipc is not None:
            m.ipc.done()
        if counted.n != expected:
            raise ModelUpdateError(f"the engine loaded {counted.n} of {expected} pushed tensors")
        return {"version": float(version), "ack_time": time.time(), "receive_s": time.perf_counter() - start}

    def mu_close(self, group: str) -> None:
        _close(_groups(self).pop(group, None))


def _close(m: _Member | None) -> None:
    """Free what a member holds for its group (a segment, a CUDA buffer or a mapping of one)."""
    if m is not None and m.shm is not None:
        m.shm.close()
    if m is not None and m.ipc is not None:
        m.ipc.close()


class _Counted:
    """An iterator that counts what its consumer took (nothing pushed may go unloaded)."""

    def __init__(self, items):
        self.items, self.n = iter(items), 0

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.items)
        self.n += 1
        return item


def member_ranks(members: list[int]) -> tuple[list[int], int]:
    """Each replica's first group rank and the group's size, the trainer being rank 0: a replica
    of ``k`` members (tensor-parallel ranks, each receiving every bucket) takes ``k`` ranks."""
    firsts, nxt = [], 1
    for k in members:
        firsts.append(nxt)
        nxt += k
    return firsts, nxt


class ModelUpdateGroup:
    """The controller's handle on trainer → engines weight pushes (see ``flash.weights.model_update``)."""

    def __init__(
        self,
        trainer,
        engines: list,
        *,
        backend: str = "auto",
        bucket_mb: float = 64.0,
        host: str = "127.0.0.1",
        timeout_s: float = 300.0,
    ):
        if not engines:
            raise ModelUpdateError("a model-update group needs at least one engine replica")
        if bucket_mb <= 0:
            raise ModelUpdateError(f"model_update.bucket_mb must be > 0, got {bucket_mb}")
        self.trainer, self.engines = trainer, list(engines)
        self.requested, self.backend = backend, None
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.host, self.timeout_s = host, timeout_s
        self.version = 0
        self.cast: dict[str, str] = {}  # the replicas' dtypes, cast to by the trainer before sending
        self.broken: str | None = None
        self.counters = {"pushes": 0, "failures": 0}
        self.group = f"flash-mu-{uuid.uuid4().hex[:8]}"  # the members' key for this group (and store prefix)

    def setup(self) -> str:
        """Choose the backend from where the members run and form the group; returns the backend."""
        where = self._get([m.mu_where.remote() for m in [self.trainer, *self.engines]], "where")
        self.backend = choose_backend(self.requested, where)
        if self.backend == "object_store":
            return self.backend
        self.cast = agreed_dtypes(self._get([e.mu_dtypes.remote() for e in self.engines], "dtypes"))
        ranks, world = member_ranks(self._get([e.mu_members.remote() for e in self.engines], "members"))
        g = self.group
        port = self._get(
            [self.trainer.mu_open.remote(g, self.backend, self.host, self.timeout_s)], "rendezvous", ["trainer"]
        )[0]
        refs = [self.trainer.mu_join.remote(g, world, self.timeout_s)]
        refs += [
            e.mu_join.remote(g, self.backend, self.host, port, rank, world, self.timeout_s)
            for rank, e in zip(ranks, self.engines)
        ]
        self._get(refs, "join")
        return self.backend

    def reset(self) -> str:
        """Form the group again under a new key, after a member actor was restarted (flash.engine.client:
        the new engine process is in no group); returns the backend."""
        self.close()
        self.group = f"flash-mu-{uuid.uuid4().hex[:8]}"
        self.broken = None
        return self.setup()

    def push(self, version: int) -> dict[str, float]:
        """Push the trainer's weights to every replica; ``self.version`` advances after all acks."""
        if self.backend is None:
            raise ModelUpdateError("ModelUpdateGroup.push before setup()")
        if self.broken:
            self.counters["failures"] += 1
            raise ModelUpdateError(f"the model-update group is broken ({self.broken}); restart the run")
        start = time.perf_counter()
        try:
            stats = self._object_store(version) if self.backend == "object_store" else self._collective(version)
        except ModelUpdateError as exc:
            self.counters["failures"] += 1
            if getattr(exc, "collective", False):
                self.broken = str(exc)
            raise
        self.version = version
        self.counters["pushes"] += 1
        return {
            "model_update/time_s": time.perf_counter() - start,
            **stats,
            "model_update/failures": float(self.counters["failures"]),
        }

    def _collective(self, version: int) -> dict[str, float]:
        wire = self._get([self.trainer.mu_plan.remote(self.group, self.bucket_bytes, self.cast)], "plan", ["trainer"])[
            0
        ]
        self._get([e.mu_check.remote(self.group, wire) for e in self.engines], "check")  # before any collective
        try:
            if self.backend in COLOCATED:  # write first, then the replicas read the same memory
                sent = self._get([self.trainer.mu_send.remote(self.group)], "send", ["trainer"])[0]
                self._get([e.mu_receive.remote(self.group, version, sent) for e in self.engines], "receive")
            else:
                refs = [self.trainer.mu_send.remote(self.group)]
                refs += [e.mu_receive.remote(self.group, version) for e in self.engines]
                sent = self._get(refs, "broadcast")[0]
        except ModelUpdateError as exc:
            exc.collective = True
            raise
        metas = [TensorMeta.from_wire(w) for w in wire]
        return {
            "model_update/bytes": float(sent["bytes"]),
            "model_update/buckets": float(len(bucket_sizes(metas))),
            "model_update/replicas": float(len(self.engines)),
        }

    def _object_store(self, version: int) -> dict[str, float]:
        """The baseline path: the state dict through Ray's object store to each replica."""
        weights = self.trainer.get_weights.remote()
        acks = self._get([e.update_weights.remote(weights, version) for e in self.engines], "object store push")
        return {
            "model_update/bytes": float(acks[0] or 0.0),
            "model_update/buckets": 1.0,
            "model_update/replicas": float(len(self.engines)),
        }

    def _get(self, refs: list, what: str, members: list[str] | None = None) -> list:
        """``ray.get`` with the group's timeout; a failure or a timeout names the members concerned."""
        members = members or self._members(len(refs))
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            late = [m for m, r in zip(members, refs) if not ray.wait([r], timeout=0)[0]]
            raise ModelUpdateError(
                f"model update: {what} timed out after {self.timeout_s:g} s; not done: "
                f"{', '.join(late)} (raise model_update.timeout_s if the model is large)"
            ) from None
        except ray.exceptions.RayError as exc:
            failed = [m for m, r in zip(members, refs) if _failed(r)]
            raise ModelUpdateError(f"model update: {what} failed on {', '.join(failed)}: {_cause(exc)}") from exc

    def _members(self, n: int) -> list[str]:
        """Labels of ``n`` refs made in the usual order: the trainer's first (if any), then the replicas'."""
        replicas = [f"replica {i}" for i in range(len(self.engines))]
        return (["trainer"] + replicas)[-n:] if n <= len(replicas) + 1 else [str(i) for i in range(n)]

    def close(self) -> None:
        for m in [self.trainer, *self.engines]:
            try:
                ray.get(m.mu_close.remote(self.group), timeout=30)
            except ray.exceptions.RayError:
                pass


def _failed(ref) -> bool:
    ready, _ = ray.wait([ref], timeout=0)
    if not ready:
        return False
    try:
        ray.get(ready[0])
        return False
    except ray.exceptions.RayError:
        return True


def _cause(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None) or exc
    return f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
