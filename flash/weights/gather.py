"""The full state dict of an FSDP2 model on one rank, in one flat collective per bucket.

Why: ``get_model_state_dict(full_state_dict=True)`` all-gathers parameter by parameter, so a
push from a trainer group paid one collective (and its latency) per tensor. Here every rank packs
the local shards of a whole bucket into one flat buffer and the buffers are gathered to rank
``dst`` in one ``dist.gather`` (buckets of ``BUCKET_BYTES``, one dtype each, two in flight so
packing and unpacking overlap the wire); only ``dst`` unflattens them into full tensors. Other
ranks keep nothing (no transient full copy either: a gather, not an all-gather). The plan (names,
ties, buckets) is made once per model (``FlatGather``); a push only reads the live shards.

For a push, each rank casts its shards to the replicas' dtype as it packs them (``cast_entries``:
a bf16 engine's push gathers bf16, on the device), and the full tensors either stay on the device
the gather ran on (``on_device``: the colocated CUDA-IPC push, no byte through host memory) or
come off it bucket by bucket through a pinned host buffer (``HostLanding``) into host memory.

Layout. FSDP2 shards dim 0 with ``torch.chunk`` semantics: every rank gets ``rows = ceil(d0 / W)``
rows, except the tail, which may get fewer or none (``d0 = 5`` on 4 ranks: 2, 2, 1, 0). Each
tensor takes a slot of ``rows * row_numel`` elements in every rank's buffer (so the buffers are
equal-sized, as a gather needs); a rank with fewer rows leaves the tail of its slot unused. Rank r's
buffer lands at ``r * S`` in the gathered one; tensor ``t`` of it is rank r's rows
``[r * rows, r * rows + rows_r)``.

What it covers: DTensors on a 1-D mesh placed ``Shard(0)`` (what ``fully_shard`` makes) or
``Replicate()``, and plain tensors (buffers, params FSDP ignores: passed through, copied). Names
are those of ``get_model_state_dict`` (the same FQN rules); names that share one tensor (a tied LM
head) come back sharing one full tensor, gathered once. Anything else (a 2-D mesh, ``Shard(1)``,
``_StridedShard``, ``Partial``) is refused by ``unsupported`` with the reason, decided from global
metadata only, so every rank takes the same path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

# gathered bytes per collective: bounds rank dst's transient buffers (two buckets in flight). On
# 2 CPU ranks over gloo a 55 MB model gathered in 0.033 s at 8 MB, 0.043 at 16, 0.10 as one bucket
# (bench/fsdp_gather.py): small buckets overlap packing with the wire and reuse heap memory
# (glibc maps allocations over 32 MB fresh each time, and page-faults them in)
BUCKET_BYTES = 8 << 20


@dataclass(frozen=True)
class Entry:
    """One distinct tensor of the state dict: its names, global shape, the dtype it is gathered in
    (``dtype``: the model's, or the replicas' when a push casts), whether its dim 0 is sharded over
    the ranks (then ``rows`` per rank slot) or every rank holds all of it, and the dtype the model
    holds it in (``held``; None: ``dtype``)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    sharded: bool
    held: torch.dtype | None = None

    @property
    def source(self) -> torch.dtype:
        """The dtype of the model's own tensor (each rank's local shard)."""
        return self.held or self.dtype

    def rows(self, world: int) -> int:
        """Rows of a rank's slot: ``ceil(d0 / world)`` (torch.chunk's chunk size)."""
        return -(-self.shape[0] // world) if self.sharded else 0

    def slot_numel(self, world: int) -> int:
        """Elements this tensor takes in each rank's flat buffer (0: replicated, not gathered)."""
        if not self.sharded:
            return 0
        return self.rows(world) * _row_numel(self.shape)


def _row_numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape[1:]:
        n *= d
    return n


def rank_rows(d0: int, world: int, rank: int) -> int:
    """Rows of a dim of ``d0`` that ``rank`` holds under torch.chunk semantics (maybe 0)."""
    rows = -(-d0 // world)
    return max(0, min(rows, d0 - rank * rows))


def sharded_state(model) -> dict[str, torch.Tensor]:
    """The model's state dict as DTensors (params) and plain tensors (buffers), no communication;
    keys are ``get_model_state_dict``'s."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))


def unsupported(state: dict[str, torch.Tensor]) -> str | None:
    """Why the flat gather cannot take ``state`` (the first offending name), or None if it can."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            return f"{name} is a {type(value).__name__}, not a tensor"
        if not isinstance(value, DTensor):
            continue
        if value.device_mesh.ndim != 1:
            return f"{name} is on a {value.device_mesh.ndim}-D mesh"
        placement = value.placements[0]
        if type(placement) is Replicate:
            continue
        if type(placement) is not Shard or placement.dim != 0 or value.dim() == 0:
            return f"{name} is placed {placement} (only Shard(0) and Replicate are gathered flat)"
    return None


def tied_names(model) -> list[tuple[str, ...]]:
    """Names the module registers one tensor under (a tied LM head), from object identity, which
    every rank shares (``state_dict()`` detaches each name into a DTensor object of its own, and a
    rank holding no rows has no storage to compare)."""
    groups: dict[int, list[str]] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(value), []).append(name)
    return [tuple(names) for names in groups.values() if len(names) > 1]


def plan_entries(state: dict[str, torch.Tensor], ties: list[tuple[str, ...]] = ()) -> list[Entry]:
    """``state``'s distinct tensors in order; the names of a tie group in ``ties`` fold into one
    entry (gathered once). A group whose names ``state`` does not all carry is left untied."""
    from torch.distributed.tensor import DTensor, Shard

    first = {n: names[0] for names in ties if all(x in state for x in names) for n in names}
    folded: dict[str, list[str]] = {}
    for name in state:
        folded.setdefault(first.get(name, name), []).append(name)
    out = []
    for names in folded.values():
        value = state[names[0]]
        sharded = isinstance(value, DTensor) and isinstance(value.placements[0], Shard)
        out.append(Entry(tuple(names), tuple(value.shape), value.dtype, sharded))
    return out


def cast_entries(entries: list[Entry], cast: Mapping[str, str] | None) -> list[Entry]:
    """``entries`` gathered in the dtypes ``cast`` names by first name (the replicas', for a push
    that casts at the sender): each rank casts its shard on its own device as it packs it, so the
    gather, and whatever follows it, moves the replicas' bytes (half of fp32's in bf16)."""
    from flash.weights.model_update import DTYPES

    cast = cast or {}
    return [replace(e, dtype=DTYPES[cast[e.names[0]]], held=e.source) if e.names[0] in cast else e for e in entries]


def plan_buckets(entries: list[Entry], world: int, bucket_bytes: int) -> list[list[Entry]]:
    """The sharded entries, grouped by dtype (one flat buffer has one dtype), cut in order into
    buckets whose gathered size stays under ``bucket_bytes``; a tensor larger than that goes alone."""
    buckets: list[list[Entry]] = []
    for dtype in dict.fromkeys(e.dtype for e in entries if e.sharded):
        current, size = [], 0
        for e in (e for e in entries if e.sharded and e.dtype == dtype):
            add = e.slot_numel(world) * world * dtype.itemsize
            if current and size + add > bucket_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(e)
            size += add
        if current:
            buckets.append(current)
    return buckets


def pack(bucket: list[Entry], locals_: list[torch.Tensor], world: int) -> torch.Tensor:
    """This rank's flat buffer of ``bucket``: each local shard at the start of its slot."""
    numel = sum(e.slot_numel(world) for e in bucket)
    flat = torch.empty(numel, dtype=bucket[0].dtype, device=locals_[0].device)  # a slot's unused tail is never read
    offset = 0
    for e, local in zip(bucket, locals_, strict=True):
        flat[offset : offset + local.numel()].copy_(local.reshape(-1))
        offset += e.slot_numel(world)
    return flat


def unpack(gathered: torch.Tensor, bucket: list[Entry], world: int) -> list[torch.Tensor]:
    """Full tensors of ``bucket`` from the gathered buffer (``world`` rank buffers end to end)."""
    per_rank = gathered.numel() // world
    out, offset = [], 0
    for e in bucket:
        full = torch.empty(e.shape, dtype=e.dtype, device=gathered.device)
        rows, row = e.rows(world), _row_numel(e.shape)
        flat_full = full.view(-1)
        for r in range(world):
            n = rank_rows(e.shape[0], world, r) * row
            start = r * per_rank + offset
            flat_full[r * rows * row : r * rows * row + n].copy_(gathered[start : start + n])
        out.append(full)
        offset += e.slot_numel(world)
    return out


def _local(value: torch.Tensor, entry: Entry, world: int, rank: int) -> torch.Tensor:
    """The rank's shard, checked against the plan's chunk layout and dtype (a mismatch would
    scramble rows: the plan is made once, so a model changed since fails here, named)."""
    local = value.to_local()
    want = (rank_rows(entry.shape[0], world, rank), *entry.shape[1:])
    if tuple(local.shape) != want or local.dtype != entry.source:
        raise RuntimeError(
            f"{entry.names[0]}: rank {rank} holds a {local.dtype} shard of shape "
            f"{tuple(local.shape)}; the plan's torch.chunk layout of {entry.source} {entry.shape} "
            f"over {world} ranks says {want}"
        )
    return local


@dataclass
class _InFlight:
    """A bucket's gather, launched (async) and not yet unpacked."""

    bucket: list[Entry]
    work: object  # the collective's handle
    flat: torch.Tensor  # this rank's packed buffer: alive until the send is done
    gathered: torch.Tensor | None  # rank dst: where the ranks' buffers land


def launch_bucket(bucket, state, dst: int, group=None) -> _InFlight:
    """Pack this rank's shards of ``bucket`` and start their gather to rank ``dst`` (async)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    flat = pack(bucket, [_local(state[e.names[0]], e, world, rank) for e in bucket], world)
    gathered = torch.empty(flat.numel() * world, dtype=flat.dtype, device=flat.device) if rank == dst else None
    chunks = list(gathered.chunk(world)) if gathered is not None else None
    return _InFlight(bucket, dist.gather(flat, chunks, dst=dst, group=group, async_op=True), flat, gathered)


class HostLanding:
    """Where gathered buckets come off a GPU for full tensors in host memory: one pinned buffer per
    dtype (``flash.staging.staging_kwargs``), grown to the largest bucket and kept across pushes
    (pinning is slow to allocate), so each bucket is one DMA copy and no pageable staging. A bucket
    gathered in host memory (gloo on CPU) is read where it is."""

    def __init__(self):
        self._pinned: dict[torch.dtype, torch.Tensor] = {}

    def __call__(self, gathered: torch.Tensor) -> torch.Tensor:
        if gathered.device.type == "cpu":
            return gathered
        from flash.staging import staging_kwargs

        buf = self._pinned.get(gathered.dtype)
        if buf is None or buf.numel() < gathered.numel():
            buf = self._pinned[gathered.dtype] = torch.empty(
                gathered.numel(), dtype=gathered.dtype, **staging_kwargs(gathered.device)
            )
        host = buf[: gathered.numel()]
        host.copy_(gathered)  # waits for the copy: the unpack reads it next
        return host


def finish_bucket(job: _InFlight, world: int, landing=None) -> list[torch.Tensor] | None:
    """Wait for a launched gather; the bucket's full tensors on rank dst, None elsewhere: where the
    gather ran (``landing`` None: on the device, no host copy) or in host memory (``landing``: a
    ``HostLanding``, then CPU slices)."""
    job.work.wait()
    if job.gathered is None:
        return None
    return unpack(job.gathered if landing is None else landing(job.gathered), job.bucket, world)


class FlatGather:
    """A model's gather plan, made once (names, tie groups, buckets: fixed once it is sharded),
    and the gather itself (``__call__``), which per push only reads the live shards.

    ``reason``: why the model cannot be gathered flat (None: it can); calling then raises.
    """

    def __init__(self, model, bucket_bytes: int = BUCKET_BYTES, group=None):
        state = sharded_state(model)
        self.model, self.group, self.bucket_bytes = model, group, bucket_bytes
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.reason = unsupported(state)
        self.names = list(state)
        self.entries = plan_entries(state, tied_names(model)) if self.reason is None else []
        self.buckets = plan_buckets(self.entries, self.world, bucket_bytes)
        # get_model_state_dict canonicalises names (wrapper prefixes) at ~5 ms a call; when the
        # module's own state_dict has the same names, a push reads that instead
        self._plain_names = set(model.state_dict()) == set(self.names)
        self._host = HostLanding()

    def _live(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict() if self._plain_names else sharded_state(self.model)

    @torch.no_grad()
    def __call__(
        self, dst: int = 0, cast: Mapping[str, str] | None = None, on_device: bool = False
    ) -> dict[str, torch.Tensor] | None:
        """Collective: the full state dict (state-dict order and names, tied names sharing one
        tensor) on rank ``dst``; None on the other ranks. ``cast``: ``{name: dtype}`` to gather in
        (``cast_entries``; the same on every rank). ``on_device``: the full tensors stay on the
        device the gather ran on (no byte through host memory), else they land in host memory."""
        if self.reason is not None:
            raise ValueError(f"flat gather does not cover this model: {self.reason}")
        entries = cast_entries(self.entries, cast) if cast else self.entries
        buckets = plan_buckets(entries, self.world, self.bucket_bytes) if cast else self.buckets
        state = self._live()
        full = self._gather_buckets(state, buckets, dst, None if on_device else self._host)
        if self.rank != dst:
            return None
        out: dict[str, torch.Tensor] = {}
        for e in entries:
            value = full[e.names] if e.sharded else _replicated(state[e.names[0]], e.dtype, on_device)
            out.update((n, value) for n in e.names)
        return {name: out[name] for name in self.names}

    def _gather_buckets(self, state, buckets, dst: int, landing) -> dict[tuple[str, ...], torch.Tensor]:
        """Every bucket's full tensors (on rank dst), two in flight: bucket k+1 is packed and on
        the wire while bucket k is unpacked, so the copies overlap the transfer."""
        full: dict[tuple[str, ...], torch.Tensor] = {}
        pending: _InFlight | None = None
        for bucket in [*buckets, None]:
            launched = launch_bucket(bucket, state, dst, self.group) if bucket is not None else None
            if pending is not None:
                tensors = finish_bucket(pending, self.world, landing)
                if tensors is not None:
                    full.update((e.names, t) for e, t in zip(pending.bucket, tensors, strict=True))
            pending = launched
        return full


def gather_full_state(
    model, dst: int = 0, bucket_bytes: int = BUCKET_BYTES, group=None
) -> dict[str, torch.Tensor] | None:
    """``FlatGather(model, bucket_bytes, group)(dst)``: a plan made and used once, its full
    tensors in host memory. Raises ValueError when ``unsupported`` names a tensor it cannot gather."""
    return FlatGather(model, bucket_bytes, group)(dst)


def _replicated(value: torch.Tensor, dtype: torch.dtype, on_device: bool) -> torch.Tensor:
    """A copy in ``dtype`` of a tensor every rank holds whole (a buffer, a Replicate DTensor):
    where it lives (``on_device``) or in host memory."""
    local = value.to_local() if hasattr(value, "to_local") else value
    return local.detach().to(dtype=dtype, copy=True) if on_device else local.detach().to("cpu", dtype, copy=True)
