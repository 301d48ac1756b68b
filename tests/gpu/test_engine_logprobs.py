"""On the GPU, the torch engine's behaviour logprobs equal the trainer's recomputed ones: exactly
enough in fp32, within a stated tolerance when the engine serves bf16 weights and the trainer
computes under bf16 autocast (its master weights fp32), which is how a bf16 run works.

The engine samples 16 tokens for each of four prompts (temperature 1, seeded); the trainer's
``token_logprobs`` scores the same sequences in one forward pass. Both take ``log_softmax`` of
fp32 logits; what differs in bf16 is the rounding inside the model: the engine rounds every
activation (the residual stream included) to bf16 and attends over a bf16 KV cache one token at a
time, while autocast rounds only the matmul inputs and keeps the residual stream in fp32.
The bodies (``check_fp32_agree``, ``check_bf16_within_bounds``) also run on CPU in the default
suite (tests/integration/test_gpu_bodies.py), where the bounds were measured.
"""

from __future__ import annotations

import torch
from tests.helpers.gpu_bodies import check_bf16_within_bounds, check_fp32_agree


def test_fp32_engine_and_trainer_agree():
    check_fp32_agree(torch.device("cuda"))


def test_bf16_engine_matches_the_trainer_under_bf16_autocast():
    check_bf16_within_bounds(torch.device("cuda"))
