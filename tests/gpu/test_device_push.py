"""The 1-GPU push on a GPU: an FSDP2 rank's gather for a CUDA-IPC push keeps the full weights on
the GPU in bf16 with no copy to the host (no `.cpu()`, no `.to("cpu")`, counted from every
caller), its host path lands them through pinned memory, and the single trainer's live weights
pack straight into a GPU buffer in bf16. The body (``check_push_stays_on_device``) also runs on
CPU with one gloo rank in the default suite (tests/integration/test_gpu_bodies.py)."""

from __future__ import annotations

import torch

from tests.helpers.gpu_bodies import check_push_stays_on_device
from tests.helpers.host_reads import HostCopies


def test_the_one_gpu_push_stays_on_the_gpu_in_bf16(model_dir, nccl_mesh, monkeypatch):
    check_push_stays_on_device(model_dir, nccl_mesh, torch.device("cuda", 0), HostCopies(monkeypatch))
