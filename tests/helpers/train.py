"""An FSDP2 trainer group on gloo and the batches it trains on."""

from __future__ import annotations

import torch

from flash.buffers import Sample
from flash.train.batch import collate
from flash.train.fsdp import GroupSettings
from flash.train.trainer import TrainerSettings

LR = 1e-3


def make_batch(seed=0, n=7, vocab=40):
    """Rows of mixed lengths; behaviour logprobs off the policy so the ratio terms are non-trivial."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(4, vocab, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        r = torch.randint(4, vocab, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        out.append(
            Sample(
                prompt_id=i // 2,
                sample_index=i % 2,
                prompt_ids=p,
                response_ids=r,
                behav_logprobs=[-3.0 - 0.1 * j for j in range(len(r))],
                versions=[0] * len(r),
                reward=float(i % 3 == 0),
            )
        )
    batch = collate(out)
    adv = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(seed + 1)) * batch.mask
    return batch, adv


def settings(agg="token-mean", **kw):
    base = dict(
        lr=LR,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        grad_clip=100.0,
        micro_batch_size=64,
        temperature=0.7,
        loss={"name": "decoupled_ppo"},
        agg=agg,
    )
    base.update(kw)
    return TrainerSettings(**base)


def toy_model():
    """A 2-layer Qwen2 over a 32-token vocabulary, seeded, in eval mode (the trainer sets train)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return Qwen2ForCausalLM(cfg).eval()


def toy_samples(seed=0, n=6) -> list[Sample]:
    """Short rows of mixed lengths for a 32-token vocabulary at version 0, behaviour logprobs -1
    (off the policy), two samples per prompt."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(3, 32, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        r = torch.randint(3, 32, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
        out.append(
            Sample(
                prompt_id=i // 2,
                sample_index=i % 2,
                prompt_ids=p,
                response_ids=r,
                behav_logprobs=[-1.0] * len(r),
                versions=[0] * len(r),
                reward=float(i % 3 == 0),
            )
        )
    return out


def toy_settings(**kw) -> TrainerSettings:
    """A single trainer's settings at a large lr (updates visible in a step or two), vanilla loss."""
    base = dict(
        lr=1e-2,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        grad_clip=100.0,
        micro_batch_size=64,
        temperature=0.7,
        loss={"name": "vanilla"},
        agg="token-mean",
    )
    return TrainerSettings(**{**base, **kw})


def start_group(model_dir, s, **group):
    from flash.train.trainer_group import start_trainer_group

    return start_trainer_group(model_dir, s, GroupSettings(**group), seed=0, threads=2, plugins=[])
