"""flash on a GPU: trainer MFU, torch-engine decode against Hugging Face ``generate``, colocated push.

    python -m bench.gpu [--shapes 0.5b,1.5b] [--seq 2048] [--micro 4] [--decode-seqs 64,256]
                        [--decode-tokens 256] [--repeats 3]
    python -m bench.gpu --smoke        # a tiny shape on CPU in well under a minute (the test suite runs it)

Models are random-initialised Qwen2 of Qwen2.5-0.5B's and 1.5B's shape (``SHAPES``: their
config.json's sizes; nothing is downloaded). Three measures, each the median of ``--repeats``:

- ``trainer``: flash's ``Trainer`` (fp32 master weights and Adam state, compute in ``--dtype``,
  activation checkpointing) on ``--micro`` rows of ``--seq`` tokens, one optimizer step per repeat.
  MFU = tokens/s × 6 × params / the card's peak dense bf16 FLOP/s (``PEAK_BF16``, read by device
  name; None on a card not in the table or on CPU). 6 × params per token is the usual forward +
  backward count; activation checkpointing's recompute is not credited, so it lowers the figure.
- ``decode``: ``TorchEngine`` (continuous batching, weights in ``--dtype``) at each of
  ``--decode-seqs`` concurrent sequences, every one ``--decode-tokens`` new tokens from a 32-token
  prompt, against ``model.generate`` (sampling, the same batch and lengths) on the same device:
  generated tokens/s of each and their ratio.
- ``push``: a colocated weight push (``ModelUpdateGroup``, backend ``auto``: CUDA IPC on one GPU,
  shared memory on CPU) from a trainer actor to an engine actor sharing the device, against a
  device-to-device copy of the same bytes in one process: GB/s of each and their ratio.

Last line: JSON (``device``, ``peak_bf16``, one entry per shape).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

# Dense bf16 tensor-core peak FLOP/s (no sparsity), from the vendors' datasheets; the first key
# found in ``torch.cuda.get_device_name()`` wins, so the more specific names come first.
PEAK_BF16 = {
    "H200": 989.4e12,
    "H100 PCIe": 756.0e12,
    "H100 NVL": 835.0e12,
    "H100": 989.4e12,
    "H800": 989.4e12,
    "GH200": 989.4e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362.05e12,
    "L40": 181.05e12,
    "A6000": 154.8e12,
    "L4": 121e12,
    "A10G": 70e12,
    "A10": 125e12,
    "RTX 4090": 165.2e12,
    "RTX 3090": 71e12,
}
# Qwen2.5-0.5B / 1.5B (their config.json); "smoke": a tiny shape for CPU.
SHAPES = {
    "0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "smoke": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=512,
        tie_word_embeddings=True,
    ),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def peak_bf16(name: str) -> float | None:
    """The card's peak dense bf16 FLOP/s by (a part of) its name; None when not in the table."""
    return next((flops for key, flops in PEAK_BF16.items() if key in name), None)


def mfu(tokens_per_s: float, params: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation: tokens/s × 6 × params / peak (None without a peak)."""
    return None if not peak else tokens_per_s * 6 * params / peak


def build_model(shape: str, seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(max_position_embeddings=32768, rope_theta=1_000_000.0, **SHAPES[shape])
    return Qwen2ForCausalLM(config)


def n_params(model) -> int:
    """Parameters, tied ones once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---- trainer ----------------------------------------------------------------------------------
def synthetic_batch(rows: int, seq: int, vocab: int, prompt: int = 64):
    """A ``TrainBatch`` of ``rows`` full rows of ``seq`` tokens, the last ``seq - prompt`` a response."""
    from flash.train.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(rows, seq - 1)
    mask[:, prompt - 1 :] = 1.0
    return TrainBatch(
        input_ids=torch.randint(0, vocab, (rows, seq), generator=g),
        attention_mask=torch.ones(rows, seq, dtype=torch.long),
        mask=mask,
        behav_logp=-torch.rand(rows, seq - 1, generator=g) * 5 * mask,
        versions=torch.zeros(rows, seq - 1, dtype=torch.long),
        rewards=torch.rand(rows, generator=g),
        group_ids=torch.arange(rows) // 2,
    )


def bench_trainer(shape: str, seq: int, micro: int, dtype: str, device: torch.device, repeats: int) -> dict:
    from flash.models import enable_activation_checkpointing
    from flash.train.trainer import Trainer, TrainerSettings

    model = build_model(shape)
    params = n_params(model)
    enable_activation_checkpointing(model.model.layers)
    settings = TrainerSettings(
        lr=1e-6,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        grad_clip=1.0,
        micro_batch_size=micro,
        temperature=1.0,
        loss={"name": "decoupled_ppo"},
        agg="token-mean",
        dtype=dtype,
    )
    trainer = Trainer(model.to(device), settings)  # fp32 master weights on the device, compute in dtype
    batch = synthetic_batch(micro, seq, model.config.vocab_size)
    adv = torch.randn(micro, seq - 1)
    seconds = timed(lambda: trainer.train_step(batch, adv, None), device, repeats)  # noqa: F821  (called before the del below)
    tokens_per_s = micro * seq / seconds
    del trainer, model
    return {
        "params": params,
        "seq": seq,
        "rows": micro,
        "step_s": seconds,
        "tokens_per_s": tokens_per_s,
        "mfu": mfu(tokens_per_s, params, peak_bf16(device_name(device))),
    }


# ---- decode -----------------------------------------------------------------------------------
def bench_decode(shape: str, seqs: int, new_tokens: int, dtype: str, device: torch.device, repeats: int) -> dict:
    from flash.engine.base import GenerationRequest, SamplingParams
    from flash.engine.torch_engine import TorchEngine

    model = build_model(shape).to(device=device, dtype=DTYPES[dtype]).eval()
    vocab = model.config.vocab_size
    prompts = torch.randint(0, vocab, (seqs, 32), generator=torch.Generator().manual_seed(1))
    engine = TorchEngine(model, max_num_seqs=seqs, seed=0)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
    runs = iter(range(10**9))

    def ours():
        run = next(runs)
        engine.generate([GenerationRequest(f"{run}-{i}", p.tolist(), params) for i, p in enumerate(prompts)])

    def hf():
        with torch.inference_mode():
            model.generate(
                prompts.to(device),
                attention_mask=torch.ones_like(prompts, device=device),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=0,
            )

    tokens = seqs * new_tokens
    ours_s, hf_s = timed(ours, device, repeats), timed(hf, device, repeats)
    return {
        "seqs": seqs,
        "new_tokens": new_tokens,
        "engine_tokens_per_s": tokens / ours_s,
        "hf_generate_tokens_per_s": tokens / hf_s,
        "ratio": hf_s / ours_s,
    }


# ---- colocated push ---------------------------------------------------------------------------
def bench_push(shape: str, dtype: str, device: torch.device, repeats: int) -> dict:
    """A trainer actor and an engine actor sharing the device; ``ModelUpdateGroup.push`` against a
    one-process device-to-device copy of the pushed bytes."""
    import ray

    from flash.cluster import init_ray
    from flash.engine.torch_worker import EngineWorker
    from flash.train.worker import TrainerWorker
    from flash.weights.group import ModelUpdateGroup

    gpu = 0.5 if device.type == "cuda" else 0
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_model(shape, Path(tmp))
        init_ray(None, 2, num_gpus=1 if gpu else 0)
        try:
            trainer = ray.remote(num_gpus=gpu)(TrainerWorker).remote(str(folder), push_settings(dtype), 0, 1, [])
            engine = ray.remote(num_gpus=gpu)(EngineWorker).remote(str(folder), 8, 0, 1, dtype=dtype)
            group = ModelUpdateGroup(trainer, [engine])
            backend = group.setup()
            ray.get(engine.pause.remote("continue"))  # a push lands in a paused engine, as in a run
            versions = iter(range(1, 10**9))
            push_s = timed(lambda: group.push(next(versions)), device, repeats)
            nbytes = group.push(next(versions))["model_update/bytes"]
            group.close()
        finally:
            ray.shutdown()
    src = torch.empty(int(nbytes), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), device, repeats)
    return {
        "backend": backend,
        "bytes": nbytes,
        "push_gb_per_s": nbytes / push_s / 1e9,
        "copy_gb_per_s": nbytes / copy_s / 1e9,
        "ratio": push_s / copy_s,
    }


def save_model(shape: str, root: Path) -> Path:
    from flash.models import build_tokenizer

    model = build_model(shape)
    folder = root / shape
    model.save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return folder


def push_settings(dtype: str):
    from flash.train.trainer import TrainerSettings

    return TrainerSettings(
        lr=1e-6,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        grad_clip=1.0,
        micro_batch_size=1,
        temperature=1.0,
        loss={"name": "decoupled_ppo"},
        agg="token-mean",
        dtype=dtype,
    )


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shape, short runs (CPU, under a minute)")
    p.add_argument("--shapes", default="0.5b,1.5b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--decode-seqs", default="64,256")
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-push", action="store_true", help="skip the push (it starts Ray)")
    a = p.parse_args(argv)
    if a.smoke:
        a.shapes, a.seq, a.micro, a.decode_seqs, a.decode_tokens, a.repeats = "smoke", 64, 2, "4,8", 8, 1
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    name = device_name(device)
    out = {"device": name, "peak_bf16": peak_bf16(name), "dtype": a.dtype, "shapes": {}}
    for shape in a.shapes.split(","):
        row = {
            "trainer": bench_trainer(shape, a.seq, a.micro, a.dtype, device, a.repeats),
            "decode": [
                bench_decode(shape, int(n), a.decode_tokens, a.dtype, device, a.repeats)
                for n in a.decode_seqs.split(",")
            ],
        }
        if not a.no_push:
            row["push"] = bench_push(shape, a.dtype, device, a.repeats)
        out["shapes"][shape] = row
        print(f"{shape}: {json.dumps(row)}", flush=True)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
