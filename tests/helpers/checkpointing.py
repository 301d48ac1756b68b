"""A one-layer trainer and a four-sample batch for the checkpoint and staging tests."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from flash import algos
from flash.buffers import Sample
from flash.train.batch import collate
from flash.train.trainer import Trainer, TrainerSettings


def small_trainer(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    settings = TrainerSettings(
        lr=1e-2,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        grad_clip=1.0,
        micro_batch_size=64,
        temperature=1.0,
        loss={"name": "vanilla"},
        agg="token-mean",
    )
    return Trainer(Qwen2ForCausalLM(cfg), settings, seed=seed)


def small_batch(seed):
    g = torch.Generator().manual_seed(seed)
    samples = [
        Sample(
            prompt_id=i // 2,
            sample_index=i % 2,
            prompt_ids=torch.randint(3, 32, (4,), generator=g).tolist(),
            response_ids=torch.randint(3, 32, (5,), generator=g).tolist(),
            behav_logprobs=[-1.0] * 5,
            versions=[0] * 5,
            reward=float(i % 2),
        )
        for i in range(4)
    ]
    batch = collate(samples)
    return batch, algos.compute_advantages("grpo", batch.rewards, batch.group_ids, batch.mask)
