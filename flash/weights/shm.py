"""Colocated weight push: one shared-memory segment instead of a socket.

When the trainer and the replicas share a device (on CPU: the same host), sending bytes through a
process group copies them into a socket and out again for every replica. Here the trainer packs
its tensors once into a shared-memory segment (a file on the ``/dev/shm`` tmpfs, mapped with
``torch.from_file(shared=True)``), the replicas map the same pages and copy
straight from them into their live parameters: no byte crosses a process boundary by copy. This is
the CPU analogue of the CUDA-IPC handles colocated GPU frameworks pass (ROLL, verl, slime).

The segment is owned by the trainer (created on the first push, grown when the model grows,
unlinked at ``close``); replicas map it by path per push and unmap when done. Layout: the buckets
of the ordinary plan (``flash.weights.model_update.plan_buckets``) laid end to end
(``pack_flat``), so a single plan and a single ``check_plan`` serve every backend; on a GPU,
``flash.weights.cuda_ipc`` does the same in device memory.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Mapping

import torch

from flash.weights.model_update import ModelUpdateError, TensorMeta, bucket_starts, pack_flat, unpack_flat

SHM_DIR = "/dev/shm"  # tmpfs: a file here is shared memory; torch.from_file(shared=True) maps it


def _map(path: str, nbytes: int) -> torch.Tensor:
    """The segment as a uint8 tensor sharing its pages (unmapped when the tensor is freed)."""
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def _allocate(path: str, nbytes: int) -> None:
    """Create the segment with its pages reserved: a tmpfs too small fails here, by name, instead
    of killing the trainer with SIGBUS at the first write past its end (Docker's /dev/shm is 64 MB)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        raise ModelUpdateError(
            f"cannot reserve {nbytes / 2**20:.0f} MiB in {SHM_DIR} ({exc.strerror}): "
            "enlarge it (docker --shm-size) or set model_update.backend=gloo"
        ) from None
    os.close(fd)


def sweep_stale(directory: str = SHM_DIR) -> list[str]:
    """Unlink segments whose owning process is gone; returns their paths.

    A trainer killed without ``close`` (OOM killer, ``ray.kill``) leaves its segment in tmpfs, i.e.
    in RAM, until reboot. Segments are named ``flash-mu-<pid>-<id>``; a later sender removes those
    whose pid no longer runs (a reused pid only keeps a stale file, never removes a live one).
    """
    removed = []
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        parts = name.split("-")
        if len(parts) != 4 or parts[:2] != ["flash", "mu"] or not parts[2].isdigit():
            continue
        try:
            os.kill(int(parts[2]), 0)
        except ProcessLookupError:
            path = os.path.join(directory, name)
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
        except PermissionError:
            pass  # alive, another user's
    return removed


class ShmSender:
    """Trainer side: owns the segment; ``write`` packs the state into it and returns its path."""

    def __init__(self) -> None:
        self.path: str | None = None
        self.seg: torch.Tensor | None = None
        sweep_stale()

    def write(self, state: Mapping[str, torch.Tensor], metas: list[TensorMeta]) -> tuple[str, int]:
        total = bucket_starts(metas)[-1]
        if self.seg is None or self.seg.numel() < total:
            self.close()
            if not os.path.isdir(SHM_DIR):
                raise ModelUpdateError(
                    f"{SHM_DIR} is missing: the shm backend needs Linux shared memory; set model_update.backend=gloo"
                )
            self.path = os.path.join(SHM_DIR, f"flash-mu-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            _allocate(self.path, max(total, 1))
            self.seg = _map(self.path, max(total, 1))
        pack_flat(state, metas, self.seg)
        return self.path, total

    def close(self) -> None:
        self.seg = None
        if self.path is not None and os.path.exists(self.path):
            os.unlink(self.path)
        self.path = None


def read(path: str, total: int, metas: list[TensorMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """Replica side: ``(name, view)`` of every tensor, views into the trainer's pages.

    The mapping lives while a view does; copy each view at once (as the engines do).
    """
    if total == 0:
        return
    need = bucket_starts(metas)[-1]
    if need != total:
        raise ModelUpdateError(f"segment {path}: {total} bytes, the plan needs {need}")
    yield from unpack_flat(_map(path, total), metas)
