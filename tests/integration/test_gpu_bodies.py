"""The bodies of tests/gpu, run on CPU in the default suite so that they cannot rot where no GPU
runs them: one FSDP2 rank on gloo under bf16 mixed precision, the 1-GPU push's gathers and
pack (no host copy, bf16 on the wire), the sync-free step with a counter
of host reads from every caller in place of CUDA's sync debug mode, and the engine-vs-trainer
logprobs in fp32 and bf16 (whose bounds were measured on CPU).

Not here, because they need CUDA itself: the CUDA-IPC push between actors sharing a GPU
(tests/unit/test_cuda_ipc.py checks its pack and unpack on CPU) and the default recipe on one GPU
(tests/e2e/test_default_recipe.py runs it on CPU).
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from flash.train.fsdp import free_port
from tests.helpers.gpu_bodies import (
    check_bf16_matches_fp32,
    check_bf16_within_bounds,
    check_fp32_agree,
    check_push_stays_on_device,
    step_under,
)
from tests.helpers.host_reads import READS, Counter, HostCopies
from tests.helpers.models import TINY, save_tiny

CPU = torch.device("cpu")


@pytest.fixture
def gloo_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_fsdp_bf16_body_on_one_gloo_rank(tmp_path, gloo_mesh):
    check_bf16_matches_fp32(save_tiny(tmp_path, TINY), gloo_mesh, CPU)


def test_device_push_body_on_one_gloo_rank(tmp_path, gloo_mesh, monkeypatch):
    check_push_stays_on_device(save_tiny(tmp_path, TINY), gloo_mesh, CPU, HostCopies(monkeypatch))


def test_sync_free_step_body_counting_every_host_read(monkeypatch):
    """Inside ``accumulate`` (sync debug "error" on a GPU) the one read allowed is of the batch's
    rows' lengths, which arrive on the CPU in a run as here (a host tensor on a GPU too)."""
    counter = Counter()
    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counter.wrap(name))
    seen = {}

    @contextmanager
    def host_reads(mode: str):
        counter.calls, counter.on = [], True
        try:
            yield
        finally:
            counter.on, seen[mode] = False, list(counter.calls)

    step_under(CPU, host_reads)
    assert len(seen["error"]) == 1 and "flash/train/trainer.py" in seen["error"][0], seen["error"]


def test_engine_logprobs_bodies_fp32_and_bf16():
    check_fp32_agree(CPU)
    check_bf16_within_bounds(CPU)
