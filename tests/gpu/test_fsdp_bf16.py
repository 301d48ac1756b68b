"""One FSDP2 rank on the GPU: a step under bf16 mixed precision (``MixedPrecisionPolicy``: bf16
compute, fp32 master weights and gradient reduction) matches the fp32 step.

Same model, batch and advantages; one optimizer step each; the loss and the gradient norm of the
step must agree within the tolerances below and must not be equal (bf16 did run). The body
(``check_bf16_matches_fp32``) also runs on CPU with one gloo rank in the default suite
(tests/integration/test_gpu_bodies.py).
"""

from __future__ import annotations

import torch

from tests.helpers.gpu_bodies import check_bf16_matches_fp32


def test_bf16_step_matches_fp32(model_dir, nccl_mesh):
    check_bf16_matches_fp32(model_dir, nccl_mesh, torch.device("cuda", 0))
