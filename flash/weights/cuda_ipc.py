"""Colocated weight push on one GPU: one CUDA buffer that the replicas map by IPC handle.

When the trainer and its replicas share one GPU, the ``shm`` backend would copy every weight from
the device into host memory and back onto the same device in each replica. Here the trainer packs
the planned buckets into one flat CUDA buffer it owns (the plan, ``check_plan`` and the
``pack_flat``/``unpack_flat`` layout of every flat backend; the plan carries the replicas' dtypes,
so the cast happens once, in the pack), exports the buffer once as a CUDA IPC handle
(``torch.multiprocessing.reductions.reduce_tensor``: plain values that Ray carries), and each
replica maps it once and copies views of it straight into its live parameters: device to device,
no host memory, no socket.

A push, in order:

1. the sender packs and then synchronizes its device, so that no replica reads a half-packed
   buffer (``IpcSender.write``);
2. each replica maps the buffer (once per buffer: its mapping is cached under the handle's key),
   copies its views into its parameters, and synchronizes its device before acknowledging
   (``IpcReceiver.done``), so that the next push's pack never overwrites a buffer still being read.

Device index: an IPC handle names the sender's device index, but each colocated actor sees its
GPU as index 0 of its own ``CUDA_VISIBLE_DEVICES``; the receiver rebuilds the buffer on its own
``torch.cuda.current_device()`` (``on_device``), as verl and slime do.

The buffer lives while the sender does (allocated on the first push, reallocated when a plan
needs more bytes, freed at ``close``); the replicas drop their mapping at ``close`` or when a
handle with a new key arrives. ``export_handle`` and ``open_handle`` are the only CUDA-specific
steps; everything else runs on any device (the tests run it on CPU tensors).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from flash.weights.model_update import DTYPES, ModelUpdateError, TensorMeta, bucket_starts, pack_flat, unpack_flat

# Position of ``storage_device`` in the arguments ``reduce_tensor`` returns for
# ``rebuild_cuda_tensor(tensor_cls, size, stride, offset, storage_cls, dtype, storage_device, ...)``.
DEVICE_ARG = 6


def cuda_device() -> torch.device:
    """This process's current GPU; a named error where it has none."""
    if not torch.cuda.is_available():
        raise ModelUpdateError(
            "model_update.backend=cuda_ipc needs a GPU in every member, and this process "
            "sees none; use shm (colocated on CPU) or auto"
        )
    return torch.device("cuda", torch.cuda.current_device())


def synchronize(device: torch.device) -> None:
    """Wait for every queued kernel and copy on ``device`` (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def export_handle(flat: torch.Tensor) -> tuple:
    """``flat``'s CUDA IPC handle: the arguments of ``rebuild_cuda_tensor`` (plain, picklable values)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    rebuild, args = reduce_tensor(flat)
    if rebuild is not rebuild_cuda_tensor:
        raise ModelUpdateError(f"cannot export a {flat.device} buffer as a CUDA IPC handle")
    return tuple(args)


def on_device(args: tuple, index: int) -> tuple:
    """A handle's rebuild arguments with the storage's device index replaced by ``index``."""
    return (*args[:DEVICE_ARG], index, *args[DEVICE_ARG + 1 :])


def open_handle(args: tuple, device: torch.device) -> torch.Tensor:
    """The sender's buffer, mapped into this process on ``device`` (its view of the shared GPU)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(*on_device(args, device.index if device.index is not None else 0))


# The classes a CUDA IPC handle names (``reduce_tensor``'s tensor and storage classes), by name:
# a handle that crosses a msgpack channel (vLLM's ``collective_rpc``) carries names, never code.
_HANDLE_CLASSES = {
    f"{c.__module__}.{c.__qualname__}": c
    for c in (torch.Tensor, torch.nn.Parameter, torch.UntypedStorage, torch.storage.TypedStorage)
}


def handle_to_wire(handle: Mapping[str, Any]) -> dict[str, Any]:
    """``IpcSender.write``'s handle as plain values (classes and dtypes by name, sizes as lists)."""

    def plain(a):
        if isinstance(a, type):
            return ["class", f"{a.__module__}.{a.__qualname__}"]
        if isinstance(a, torch.dtype):
            return ["dtype", str(a).removeprefix("torch.")]
        return list(a) if isinstance(a, tuple) else a

    return {**handle, "args": [plain(a) for a in handle["args"]]}


def handle_from_wire(handle: Mapping[str, Any]) -> dict[str, Any]:
    """``handle_to_wire``'s inverse; a class or dtype outside the known few is refused."""

    def back(a):
        if isinstance(a, list) and len(a) == 2 and a[0] == "class":
            if a[1] not in _HANDLE_CLASSES:
                raise ModelUpdateError(f"a CUDA IPC handle names an unknown class {a[1]!r}")
            return _HANDLE_CLASSES[a[1]]
        if isinstance(a, list) and len(a) == 2 and a[0] == "dtype":
            return DTYPES[a[1]] if a[1] in DTYPES else _refuse(a[1])
        return tuple(a) if isinstance(a, list) else a

    return {**handle, "args": tuple(back(a) for a in handle["args"])}


def _refuse(dtype: str):
    raise ModelUpdateError(f"a CUDA IPC handle names an unknown dtype {dtype!r}")


class IpcSender:
    """Trainer side: owns the flat buffer; ``write`` packs a plan into it and returns its handle."""

    def __init__(self, device: torch.device | None = None):
        self.device = device if device is not None else cuda_device()
        self.flat: torch.Tensor | None = None
        self.handle: dict[str, Any] | None = None  # exported once per buffer

    def write(self, state: Mapping[str, torch.Tensor], metas: list[TensorMeta]) -> dict[str, Any]:
        """Pack ``state`` as ``metas`` plans (cast to their dtypes) and wait until it is in the
        buffer; returns ``{"key", "args", "bytes"}`` for ``IpcReceiver.read``."""
        total = bucket_starts(metas)[-1]
        if self.flat is None or self.flat.numel() < total:
            self.close()
            self.flat = torch.empty(max(total, 1), dtype=torch.uint8, device=self.device)
            self.handle = {"key": uuid.uuid4().hex, "args": export_handle(self.flat)}
        pack_flat(state, metas, self.flat)
        synchronize(self.device)
        return {**self.handle, "bytes": total}

    def close(self) -> None:
        self.flat, self.handle = None, None


class IpcReceiver:
    """Replica side: the sender's buffer mapped once (per key) and read as views of its tensors."""

    def __init__(self, device: torch.device | None = None):
        self.device = device if device is not None else cuda_device()
        self.key: str | None = None
        self.flat: torch.Tensor | None = None

    def read(self, handle: Mapping[str, Any], metas: list[TensorMeta]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, view)`` of every planned tensor, views into the sender's buffer: copy each at
        once, then call ``done`` before acknowledging the push."""
        if handle["key"] != self.key:
            self.close()  # the sender reallocated: its old buffer is no longer written
            self.flat = open_handle(handle["args"], self.device)
            self.key = handle["key"]
        return unpack_flat(self.flat, metas)

    def done(self) -> None:
        """Wait until this replica's copies out of the buffer have run (the sender may refill it)."""
        synchronize(self.device)

    def close(self) -> None:
        self.key, self.flat = None, None
