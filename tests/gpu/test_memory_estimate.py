"""The memory estimate `flash validate` prints (flash.app.memory_trace, fake tensors on the CPU)
against what the GPU's allocator reserves for the same work: a trainer step of one micro-batch at
Qwen2.5-0.5B's shape (bf16 compute, activation checkpointing, the AdamW state already there) and the
torch engine's prefill of a batch. The aim is within 15% of ``torch.cuda.max_memory_reserved``;
each test prints both numbers for BENCHMARKS.md."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from flash.app.memory_trace import PrefillShape, TrainShape, prefill_bytes, train_phases

GIB = 2**30
AIM = 0.15


def qwen25_05b() -> Qwen2Config:
    return Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    )


def _reserved_peak(work) -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    work()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_reserved()


def test_trainer_step_estimate_is_within_15_percent_of_the_reserved_peak():
    from flash.models import enable_activation_checkpointing
    from flash.train.batch import TrainBatch
    from flash.train.fsdp import decoder_layers
    from flash.train.trainer import Trainer, TrainerSettings

    rows, length = 4, 1024
    shape = TrainShape(rows, length, 0, "bfloat16", True)
    estimate = train_phases(qwen25_05b(), shape).peak
    model = Qwen2ForCausalLM(qwen25_05b()).cuda()
    enable_activation_checkpointing(decoder_layers(model))
    settings = TrainerSettings(
        lr=1e-6,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        grad_clip=1.0,
        micro_batch_size=rows,
        temperature=1.0,
        loss={"name": "ppo", "old_policy": "prox"},
        agg="token-mean",
        dtype="bfloat16",
    )
    trainer = Trainer(model, settings)
    cols = length - 1
    batch = TrainBatch(
        input_ids=torch.randint(0, 151936, (rows, length)),
        attention_mask=torch.ones(rows, length, dtype=torch.long),
        mask=torch.ones(rows, cols),
        behav_logp=torch.full((rows, cols), -1.0),
        versions=torch.zeros(rows, cols, dtype=torch.long),
        rewards=torch.zeros(rows),
        group_ids=torch.zeros(rows, dtype=torch.long),
    )
    adv = torch.randn(rows, cols)

    def step():
        trainer.begin_step()
        trainer.accumulate(batch, adv, None)
        trainer.finish_step()

    step()  # the AdamW state now exists, as on every later step
    reserved = _reserved_peak(step)
    print(
        f"trainer step at {rows}x{length}: estimate {estimate / GIB:.2f} GiB, reserved {reserved / GIB:.2f} GiB "
        f"on {torch.cuda.get_device_name()}"
    )
    assert abs(estimate - reserved) <= AIM * reserved


def test_torch_engine_prefill_estimate_is_within_15_percent_of_the_reserved_peak():
    from flash.engine.base import GenerationRequest, SamplingParams
    from flash.engine.torch_engine import TorchEngine

    shape = PrefillShape(rows=256, prompt=512, budget=16384, dtype="bfloat16")
    estimate = prefill_bytes(qwen25_05b(), shape)
    model = Qwen2ForCausalLM(qwen25_05b()).to(device="cuda", dtype=torch.bfloat16)
    engine = TorchEngine(model, max_num_seqs=shape.rows, max_num_batched_tokens=shape.budget)
    for i in range(shape.rows):
        engine.add_request(GenerationRequest(f"r{i}", [1] * (shape.prompt + 1), SamplingParams(max_new_tokens=1)))

    def admit():
        with torch.inference_mode():
            engine._admit()

    reserved = _reserved_peak(admit)
    print(
        f"torch-engine prefill of {shape.rows}x{shape.prompt}: estimate {estimate / GIB:.2f} GiB, reserved "
        f"{reserved / GIB:.2f} GiB on {torch.cuda.get_device_name()}"
    )
    assert abs(estimate - reserved) <= AIM * reserved
