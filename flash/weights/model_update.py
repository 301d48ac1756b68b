"""Model-update group: the trainer's weights into every engine replica, in buckets.

Why not Ray's object store (the ``object_store`` backend): it pickles the whole state dict into shared
memory, then every replica unpickles its own full copy before copying into its parameters -- two
extra full copies per replica and a peak of 2x the model in each engine. Here the trainer (rank 0)
and every replica (ranks 1..N) form their own torch.distributed process group and the weights go as
a few large broadcasts straight into the replicas' live parameters:

1. **plan** (trainer): the full state dict, tied weights counted once (``unique_tensors``), each
   tensor in the dtype the replicas hold it in (``agreed_dtypes`` of their ``mu_dtypes``: the
   trainer casts, so a bf16 engine receives bf16 bytes), cut into buckets of ``bucket_mb``
   (``plan_buckets``, pure). The plan travels as plain lists (``TensorMeta.to_wire``): names,
   shapes, dtypes, byte offsets. No tensor is pickled.
2. **check** (every replica, before any collective): every name exists with the same shape and
   every replica parameter is covered. A replica that would fail mid-broadcast would leave the
   others blocked inside a collective (the "weight sync hangs" users of peers report); failing
   here instead is a clean, named error.
3. **broadcast**: small tensors are packed into one contiguous byte buffer per bucket, broadcast,
   and unpacked as views the engine copies in place; two buffers alternate, so packing/unpacking
   bucket k overlaps the wire time of its neighbour. A tensor of at least ``ALONE_BYTES`` travels
   alone and zero-copy: broadcast from the trainer's own storage, received straight into the
   paused engine's live parameter (on CPU every extra memcpy pass costs about as much as the
   loopback transfer itself, so this is what keeps a push near the raw broadcast).
4. **ack**: each replica sets its engine version when its last bucket is in; the controller's
   version advances only after *every* replica has acknowledged (``ModelUpdateGroup.push``).

The group is not torch's default group: each member builds a bare ``ProcessGroupGloo`` /
``ProcessGroupNCCL`` over its own ``TCPStore`` (free port, ``host``), the "stateless" group peers
(OpenRLHF, open-instruct, vLLM's ``StatelessProcessGroup``) use for the same reason: an FSDP
trainer's default group and the engines' own groups must not see it.

Backends (``model_update.backend``): ``gloo`` (CPU tensors over TCP), ``nccl`` (CUDA), ``shm``
(colocated, :mod:`flash.weights.shm`: the trainer packs into one shared-memory segment that the
replicas map, so no byte crosses a socket), ``cuda_ipc`` (colocated on one GPU,
:mod:`flash.weights.cuda_ipc`: the same packing into one CUDA buffer that the replicas map by IPC
handle, so no byte leaves the GPU), ``object_store`` (the simplest path, kept as the baseline),
``auto`` (``flash.weights.group.choose_backend``). ``shm`` and ``cuda_ipc`` lay the planned buckets
end to end in one flat buffer (``bucket_starts``, ``pack_flat``, ``unpack_flat``).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.distributed as dist

from flash.algos.registry import did_you_mean
from flash.errors import FlashError

ALIGN = 64  # byte alignment of every tensor in a bucket: views of any dtype stay aligned
# A tensor this large travels alone, zero-copy at both ends. On CPU, packing and unpacking are
# memcpy passes that cost as much as the loopback transfer itself (measured: ~1 GB/s per core under
# load, like gloo); a broadcast of its own costs ~0.1 ms of latency, i.e. ~100 KB of memcpy.
ALONE_BYTES = 1 << 20
DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
ModelUpdateBackend = Literal["auto", "gloo", "nccl", "shm", "cuda_ipc", "object_store"]  # model_update.backend
BACKENDS: tuple[str, ...] = get_args(ModelUpdateBackend)


class ModelUpdateError(FlashError):
    """A weight push that could not complete; the message names the replica and the cause."""


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of a push: where it sits in which bucket, and every name it is loaded under."""

    names: tuple[str, ...]  # the first and any aliases sharing its storage (tied embeddings)
    shape: tuple[int, ...]
    dtype: str
    bucket: int
    offset: int  # bytes from the start of its bucket
    nbytes: int

    def to_wire(self) -> list:
        return [list(self.names), list(self.shape), self.dtype, self.bucket, self.offset, self.nbytes]

    @classmethod
    def from_wire(cls, item: list) -> TensorMeta:
        names, shape, dtype, bucket, offset, nbytes = item
        if dtype not in DTYPES:
            raise ModelUpdateError(f"tensor {names[0]!r}: unsupported dtype {dtype!r}; one of {sorted(DTYPES)}")
        return cls(tuple(names), tuple(int(s) for s in shape), dtype, int(bucket), int(offset), int(nbytes))


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ModelUpdateError(f"cannot push a {name} tensor; supported dtypes: {sorted(DTYPES)}")
    return name


def unique_tensors(state: Mapping[str, torch.Tensor]) -> list[tuple[tuple[str, ...], torch.Tensor]]:
    """``state``'s tensors with aliases folded: a tied LM head is sent once, loaded under both names."""
    seen: dict[tuple, int] = {}
    out: list[tuple[list[str], torch.Tensor]] = []
    for name, t in state.items():
        real = t.numel() and t.device.type != "meta"  # no storage: nothing to alias
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) if real else None
        if key is not None and key in seen:
            out[seen[key]][0].append(name)
            continue
        if key is not None:
            seen[key] = len(out)
        out.append(([name], t))
    return [(tuple(names), t) for names, t in out]


def redundant_names(metas: list[TensorMeta], ties: list[tuple[str, ...]]) -> set[str]:
    """Alias names a receiver need not load: tied to the tensor's first name in its *own* model too.

    Loading a tied LM head under both names would copy the embedding twice into one storage (on
    SmolLM2-135M, 113 MB per replica for nothing). A receiver whose model is untied loads both.
    """
    group_of = {name: i for i, group in enumerate(ties) for name in group}
    skip = set()
    for m in metas:
        first = group_of.get(m.names[0])
        skip.update(n for n in m.names[1:] if first is not None and group_of.get(n) == first)
    return skip


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(
    entries: list[tuple[tuple[str, ...], tuple[int, ...], str]], bucket_bytes: int, alone_bytes: int = ALONE_BYTES
) -> list[TensorMeta]:
    """Large tensors travel alone; all small ones share as few buckets of ``bucket_bytes`` as fit.

    A tensor of at least ``min(alone_bytes, bucket_bytes)`` gets a bucket of its own (never split):
    it is broadcast from the trainer's own storage and received straight into the replica's live
    parameter, with no packing or unpacking copy at either end. Small tensors (norms, small
    projections) fill the open small bucket wherever they sit in the model, so a 30-layer model
    costs one broadcast per large tensor plus one or two for all the rest, not one per layer.
    Buckets are numbered in the order they open; the result is sorted by (bucket, offset).
    """
    if bucket_bytes <= 0:
        raise ModelUpdateError(f"bucket size must be > 0 bytes, got {bucket_bytes}")
    alone = min(alone_bytes, bucket_bytes)
    metas, next_id, small, fill = [], 0, None, 0
    for names, shape, dtype in entries:
        nbytes = DTYPES[dtype].itemsize * _numel(shape)
        if nbytes >= alone:
            metas.append(TensorMeta(tuple(names), tuple(shape), dtype, next_id, 0, nbytes))
            next_id += 1
            continue
        if small is None or fill + nbytes > bucket_bytes:
            small, fill, next_id = next_id, 0, next_id + 1
        metas.append(TensorMeta(tuple(names), tuple(shape), dtype, small, fill, nbytes))
        fill = _aligned(fill + nbytes)
    return sorted(metas, key=lambda m: (m.bucket, m.offset))


def plan_state(
    state: Mapping[str, torch.Tensor], bucket_bytes: int, cast: Mapping[str, str] | None = None
) -> list[TensorMeta]:
    """The plan of a push of ``state``: aliases folded (``unique_tensors``), each tensor in the
    dtype ``cast`` names for it (the replicas', where the sender casts) or else its own."""
    cast = cast or {}
    entries = [(names, tuple(t.shape), cast.get(names[0]) or dtype_name(t.dtype)) for names, t in unique_tensors(state)]
    return plan_buckets(entries, bucket_bytes)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def bucket_sizes(metas: list[TensorMeta]) -> list[int]:
    """Bytes of each bucket (the end of its last tensor)."""
    sizes: dict[int, int] = {}
    for m in metas:
        sizes[m.bucket] = max(sizes.get(m.bucket, 0), m.offset + m.nbytes)
    return [sizes[k] for k in range(len(sizes))]


def by_bucket(metas: list[TensorMeta]) -> list[list[TensorMeta]]:
    out: list[list[TensorMeta]] = []
    for m in metas:
        if m.bucket == len(out):
            out.append([])
        out[m.bucket].append(m)
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def pack(tensors: list[torch.Tensor], metas: list[TensorMeta], out: torch.Tensor) -> torch.Tensor:
    """Copy a bucket's tensors into ``out`` (uint8) at their offsets; returns the used prefix."""
    for t, m in zip(tensors, metas):
        out[m.offset : m.offset + m.nbytes].copy_(as_bytes(t.contiguous()), non_blocking=True)
    return out[: metas[-1].offset + metas[-1].nbytes]


def unpack(buf: torch.Tensor, metas: list[TensorMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """Views of a received bucket, one ``(name, tensor)`` per name (aliases share the view)."""
    for m in metas:
        view = buf[m.offset : m.offset + m.nbytes].view(DTYPES[m.dtype]).view(m.shape)
        for name in m.names:
            yield name, view


def bucket_starts(metas: list[TensorMeta]) -> list[int]:
    """Byte offset of each bucket in a flat buffer (buckets end to end, ``ALIGN``-ed), then the end."""
    starts, at = [], 0
    for size in bucket_sizes(metas):
        starts.append(at)
        at += _aligned(size)
    return starts + [at]


def pack_flat(state: Mapping[str, torch.Tensor], metas: list[TensorMeta], flat: torch.Tensor) -> int:
    """Every planned tensor of ``state`` into ``flat`` (uint8) at ``bucket_starts``, each copied
    straight into its typed view of ``flat`` (the copy moves it to ``flat``'s device and casts it
    to its planned dtype: no cast copy of a tensor beside the buffer); returns the bytes used. The
    copies may still be in flight on a GPU: synchronize before another process reads ``flat``."""
    starts, non_blocking = bucket_starts(metas), flat.device.type == "cuda"
    for k, group in enumerate(by_bucket(metas)):
        for m in group:
            at = starts[k] + m.offset
            view = flat[at : at + m.nbytes].view(DTYPES[m.dtype]).view(m.shape)
            view.copy_(state[m.names[0]].detach(), non_blocking=non_blocking)
    return starts[-1]


def unpack_flat(flat: torch.Tensor, metas: list[TensorMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, view)`` of every planned tensor in a buffer ``pack_flat`` filled (views, no copy)."""
    starts = bucket_starts(metas)
    if flat.numel() < starts[-1]:
        raise ModelUpdateError(f"the pushed buffer holds {flat.numel()} bytes, the plan needs {starts[-1]}")
    for k, group in enumerate(by_bucket(metas)):
        yield from unpack(flat[starts[k] : starts[k + 1]], group)


def agreed_dtypes(per_replica: list[Mapping[str, str]]) -> dict[str, str]:
    """``{name: dtype}`` every replica loads in the same dtype (a push may cast to it at the sender);
    a name any replica lacks or holds in another dtype keeps the trainer's dtype."""
    if not per_replica:
        return {}
    first, rest = per_replica[0], per_replica[1:]
    return {name: dtype for name, dtype in first.items() if all(r.get(name) == dtype for r in rest)}


def check_plan(metas: list[TensorMeta], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Raise ModelUpdateError unless ``metas`` covers exactly the parameters ``shapes`` names.

    Dtypes may differ (the copy casts, e.g. an fp32 trainer into a bf16 engine); shapes may not.
    """
    sent = set()
    for m in metas:
        for name in m.names:
            sent.add(name)
            if name not in shapes:
                raise ModelUpdateError(
                    f"the engine has no parameter {name!r}{did_you_mean(name, shapes, n=1)} "
                    "(trainer and engine must load the same architecture)"
                )
            if tuple(shapes[name]) != m.shape:
                raise ModelUpdateError(f"{name}: trainer shape {m.shape} != engine shape {tuple(shapes[name])}")
    missing = sorted(set(shapes) - sent)
    if missing:
        raise ModelUpdateError(
            f"the trainer sends no value for {len(missing)} engine parameter(s), e.g. "
            f"{missing[:3]}; they would keep stale weights"
        )


# ---- transport ---------------------------------------------------------------------------------
def open_store(host: str, timeout_s: float, port: int = 0, world: int | None = None) -> dist.TCPStore:
    """A rendezvous owned by rank 0: a TCPStore listening on ``host`` only (``port`` 0: a free one).

    TCPStore binds its own server socket to every interface whatever ``host`` says; handed a
    socket bound here (``master_listen_fd``), it serves on that one address, so a loopback store
    is reachable from this machine only."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    bound = sock.getsockname()[1]
    return dist.TCPStore(
        host,
        bound,
        world_size=world,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        master_listen_fd=sock.detach(),
    )


def make_group(backend: str, store: dist.Store, prefix: str, rank: int, world: int, timeout_s: float):
    """A bare process group over ``store`` (blocks until all ``world`` members arrive).

    Not registered with torch.distributed: no default group is created or disturbed.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    scoped = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(scoped, rank, world, timeout)
    if backend == "nccl":
        if not (torch.cuda.is_available() and hasattr(dist, "ProcessGroupNCCL")):
            raise ModelUpdateError("model_update.backend=nccl needs CUDA and a torch built with NCCL; use gloo")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(scoped, rank, world, opts)
    raise ModelUpdateError(f"no process group for backend {backend!r}; expected gloo or nccl")


def connect(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def broadcast(pg, tensor: torch.Tensor):
    """Start a broadcast from rank 0; returns the Work to ``wait()`` on."""
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    return pg.broadcast([tensor], opts)


class _Buffers:
    """Two reusable byte buffers per member (double buffering), grown on demand, kept across pushes."""

    def __init__(self, device: torch.device):
        self.device, self.bufs = device, [torch.empty(0, dtype=torch.uint8, device=device)] * 2

    def get(self, slot: int, nbytes: int) -> torch.Tensor:
        if self.bufs[slot].numel() < nbytes:
            self.bufs[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self.bufs[slot]


def send(pg, state: Mapping[str, torch.Tensor], metas: list[TensorMeta], buffers: _Buffers) -> int:
    """Rank 0: broadcast every bucket of ``metas`` from ``state``, each tensor in its planned dtype
    (the replicas', when the plan casts); returns the bytes sent.

    Packing bucket k overlaps the broadcast of bucket k-1 (at most one broadcast in flight, each
    buffer reused only after its broadcast has completed).
    """
    pending, sent = None, 0
    for k, group in enumerate(by_bucket(metas)):
        tensors = [state[m.names[0]].detach().to(buffers.device, DTYPES[m.dtype]) for m in group]
        if len(group) == 1:
            buf = as_bytes(tensors[0].contiguous())  # one tensor: its own storage (or its cast copy)
        else:
            buf = pack(tensors, group, buffers.get(k % 2, group[-1].offset + group[-1].nbytes))
        if buffers.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        if pending is not None:
            pending.wait()
        pending, sent = broadcast(pg, buf), sent + buf.numel()
    if pending is not None:
        pending.wait()
    return sent


def _landing(metas: list[TensorMeta], targets: Mapping[str, torch.Tensor] | None, device: torch.device):
    """The live parameter a lone tensor can be received into directly, or None."""
    if targets is None or len(metas) != 1:
        return None
    m = metas[0]
    t = targets.get(m.names[0])
    if t is None or tuple(t.shape) != m.shape or dtype_name(t.dtype) != m.dtype or not t.is_contiguous():
        return None
    return t if t.device == device else None


def receive(
    pg, metas: list[TensorMeta], buffers: _Buffers, targets: Mapping[str, torch.Tensor] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Ranks 1..N: yield ``(name, tensor)`` for every pushed tensor, bucket by bucket.

    A lone tensor whose live parameter is in ``targets`` (same shape, dtype, device, contiguous)
    is received straight into it and yielded as a view of it, so the consumer's ``copy_`` is a
    no-op; call this only where writing the live weights is allowed (a paused engine). Any other
    view is valid until the next one is requested (its buffer is refilled two buckets later), so
    the consumer must copy it at once (``TorchEngine.update_weights`` does). Bucket k+1 is on the
    wire while the consumer copies bucket k.
    """
    groups, sizes = by_bucket(metas), bucket_sizes(metas)

    def post(k: int):
        target = _landing(groups[k], targets, buffers.device)
        dest = as_bytes(target) if target is not None else buffers.get(k % 2, sizes[k])[: sizes[k]]
        return dest, broadcast(pg, dest)

    pending = post(0) if groups else None
    for k, group in enumerate(groups):
        current, work = pending
        work.wait()
        if k + 1 < len(groups):
            pending = post(k + 1)
        yield from unpack(current, group)
