"""One FSDP2 rank on the GPU: a step under bf16 mixed precision (``MixedPrecisionPolicy``: bf16
compute, fp32 master weights and gradient reduction) matches the fp32 step.

Same model, batch and advantages; one optimizer step each; the loss and the gradient norm of the
step must agree within the tolerances below and must not be equal (bf16 did run).
"""

from __future__ import annotations

import pytest
import torch

from flash.cluster import load_model
from flash.train.fsdp import GroupSettings, ShardedTrainer, batch_to, free_port
from tests.helpers.models import TINY, save_tiny
from tests.helpers.train import make_batch, settings

# bf16 keeps ~3 significant digits; the loss is a mean over ~40 tokens of terms computed from bf16
# logits, so it agrees to ~1e-2 relative (the CPU test of the same policy, tests/test_fsdp_trainer.py,
# holds it to 3e-2). The gradient norm sums squares of bf16-computed gradients over every parameter,
# a longer chain of roundings: 5e-2 relative.
LOSS_REL, GRAD_NORM_REL = 3e-2, 5e-2


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


def one_step(model_dir, mesh, mixed_precision: str) -> dict:
    device = torch.device("cuda", 0)
    tr = ShardedTrainer(load_model(model_dir), settings(), GroupSettings(mixed_precision=mixed_precision), mesh,
                        device)
    batch, adv = make_batch(seed=3)
    batch, adv = batch_to(batch, device), adv.to(device)
    plan = [list(range(len(batch)))]
    return tr.planned_step(batch, adv, batch.behav_logp, plan, total=float(batch.mask.sum()))  # token-mean


def test_bf16_step_matches_fp32(model_dir, mesh):
    fp32, bf16 = one_step(model_dir, mesh, "fp32"), one_step(model_dir, mesh, "bf16")
    assert bf16["partial"]["loss"] == pytest.approx(fp32["partial"]["loss"], rel=LOSS_REL)
    assert bf16["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=GRAD_NORM_REL)
    assert bf16["partial"]["loss"] != fp32["partial"]["loss"]
    assert fp32["grad_norm"] > 0 and bf16["skipped"] == fp32["skipped"] == 0.0
