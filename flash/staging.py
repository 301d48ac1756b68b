"""Checkpoint snapshots in host memory: a trainer's state copied off its device between steps.

A snapshot is written while training goes on (``flash.checkpoint``), so it must not share memory
with the live weights and AdamW state. Cloning them on the device would hold a second copy of the
whole state there (for a 7 B model over 4 ranks, tens of GiB per rank at a checkpoint step); a
``HostStager`` copies every device tensor into a host buffer instead:

- on a CUDA device the buffer is pinned (page-locked: ``staging_kwargs``), the copies are issued
  ``non_blocking`` (DMA, overlapping each other) and the device is synchronized once before the
  snapshot is handed to the writer thread, so the writer reads complete bytes;
- the buffers are kept and reused by the next snapshot whose tensor at the same place has the same
  shape and dtype (pinning is slow to allocate; the writer of the previous checkpoint is done by
  then: ``CheckpointWriter`` waits for it before taking a snapshot);
- a tensor already in host memory is cloned (a fresh tensor freed with the snapshot, so a CPU
  run keeps no second copy between checkpoints, and its checkpoint's bytes are a clone's).

A DTensor (an FSDP2 rank's shard) stays a DTensor: its local shard goes into the host buffer, as
``torch.distributed.checkpoint``'s own asynchronous staging does it, so DCP saves it unchanged.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

Where = tuple  # where a tensor sits in the nested state: the keys and indices down to it


def staging_kwargs(device: torch.device | str) -> dict[str, Any]:
    """The ``torch.empty`` arguments of the host buffer a tensor on ``device`` is copied into:
    pinned host memory for a CUDA device (an asynchronous DMA copy), plain host memory otherwise."""
    return {"device": "cpu", "pin_memory": True} if torch.device(device).type == "cuda" else {"device": "cpu"}


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed has no DTensor
        return False
    return isinstance(t, DTensor)


class HostStager:
    """Host copies of (nested) state dicts, their device tensors' buffers reused across calls.
    ``host_kinds``: the device kinds whose tensors are cloned as they are (the host's own)."""

    def __init__(self, host_kinds: tuple[str, ...] = ("cpu",)):
        self.host_kinds = host_kinds
        self._buffers: dict[Where, torch.Tensor] = {}

    def stage(self, obj: Any) -> Any:
        """A copy of ``obj`` with every tensor in host memory, complete when this returns: dicts
        become plain dicts, lists and tuples keep their type, other leaves are deep-copied."""
        pending: set[torch.device] = set()
        out = self._copy(obj, (), pending)
        for device in pending:
            torch.cuda.synchronize(device)
        return out

    def _copy(self, obj: Any, path: Where, pending: set) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj.detach(), path, pending)
        if isinstance(obj, dict):
            return {k: self._copy(v, (*path, k), pending) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, (*path, i), pending) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def _tensor(self, t: torch.Tensor, path: Where, pending: set) -> torch.Tensor:
        if t.device.type in self.host_kinds:
            return t.clone()
        local = t._local_tensor if _is_dtensor(t) else t
        buf = self._buffers.get(path)
        if buf is None or not _fits(buf, local):
            buf = self._buffers[path] = _host_buffer(t)
        kwargs = staging_kwargs(local.device)
        (buf._local_tensor if _is_dtensor(buf) else buf).copy_(local, non_blocking=kwargs.get("pin_memory", False))
        if kwargs.get("pin_memory"):
            pending.add(local.device)
        return buf


def _fits(buf: torch.Tensor, local: torch.Tensor) -> bool:
    host = buf._local_tensor if _is_dtensor(buf) else buf
    return host.shape == local.shape and host.dtype == local.dtype


def _empty(local: torch.Tensor) -> torch.Tensor:
    kwargs = staging_kwargs(local.device) if local.numel() else {"device": "cpu"}  # nothing to pin
    return torch.empty(local.shape, dtype=local.dtype, **kwargs)


def _host_buffer(t: torch.Tensor) -> torch.Tensor:
    """A new host buffer for ``t``: a plain tensor, or a DTensor (same mesh and placements) whose
    local shard is the buffer, as ``torch.distributed.checkpoint``'s staging builds it."""
    if not _is_dtensor(t):
        return _empty(t)
    host = t.to("cpu")
    host._local_tensor = _empty(t._local_tensor)
    return host
