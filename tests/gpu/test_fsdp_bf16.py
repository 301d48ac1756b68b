"""One FSDP2 rank on the GPU: a step under bf16 mixed precision (``MixedPrecisionPolicy``: bf16
compute, fp32 master weights and gradient reduction) matches the fp32 step.

Same model, batch and advantages; one optimizer step each; the loss and the gradient norm of the
step must agree within the tolerances below and must not be equal (bf16 did run). The body
(``check_bf16_matches_fp32``) also runs on CPU with one gloo rank in the default suite
(tests/integration/test_gpu_bodies.py).
"""

from __future__ import annotations

import pytest
import torch
from flash.train.fsdp import free_port
from tests.helpers.models import TINY, save_tiny
from tests.helpers.gpu_bodies import check_bf16_matches_fp32


@pytest.fixture(scope="module")
def mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield init_device_mesh("cuda", (1,))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"), TINY)


def test_bf16_step_matches_fp32(model_dir, mesh):
    check_bf16_matches_fp32(model_dir, mesh, torch.device("cuda", 0))
