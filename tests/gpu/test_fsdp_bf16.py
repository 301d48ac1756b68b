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

from algos.metrics import finalize
from flash.cluster import load_model
from flash.train.batch import batch_to
from flash.train.fsdp import GroupSettings, ShardedTrainer, free_port
from tests.helpers.models import TINY, save_tiny
from tests.helpers.train import make_batch, settings

# Measured with the same step on CPU (one gloo rank, seed 3): loss rel 5.5e-4, grad norm rel 3.2e-4.
# bf16 keeps ~3 significant digits per value, but the loss and the norm are sums of many terms, so
# their errors average out; the bounds leave ~10x for the GPU's kernels. A weighting error (the
# gradient not divided by the step's total weight) moves the norm by a factor of ~40.
LOSS_REL, GRAD_NORM_REL = 5e-3, 5e-3


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


def one_step(model_dir, mesh, dtype: str, device: torch.device) -> dict:
    tr = ShardedTrainer(load_model(model_dir), settings(dtype=dtype), GroupSettings(), mesh, device)
    batch, adv = make_batch(seed=3)
    batch, adv = batch_to(batch, device), adv.to(device)
    plan = [list(range(len(batch)))]
    return tr.planned_step(batch, adv, batch.behav_logp, plan, total=float(batch.mask.sum()))  # token-mean


def check_bf16_matches_fp32(model_dir, mesh, device: torch.device) -> None:
    fp32, bf16 = one_step(model_dir, mesh, "float32", device), one_step(model_dir, mesh, "bfloat16", device)
    loss32, loss16 = finalize(fp32["partials"])["loss"], finalize(bf16["partials"])["loss"]
    assert loss16 == pytest.approx(loss32, rel=LOSS_REL)
    assert bf16["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=GRAD_NORM_REL)
    assert loss16 != loss32
    assert fp32["grad_norm"] > 0 and bf16["skipped"] == fp32["skipped"] == 0.0


def test_bf16_step_matches_fp32(model_dir, mesh):
    check_bf16_matches_fp32(model_dir, mesh, torch.device("cuda", 0))
