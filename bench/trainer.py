"""Trainer throughput: the single-process trainer vs FSDP2 groups of 1 and 2 ranks, side by side.

    python -m bench.trainer [--repeats 5] [--rows 128] [--threads 2] [--hidden 128 --layers 4]
                            [--groups fsdp1,fsdp2,fsdp2_micro1024]

Every variant gets the same batch (the default recipe's shape: 128 rows, prompts of ~20 tokens,
long-tailed responses up to 48) and the same total torch threads (split over a group's ranks), and
runs the same train steps; repeats are interleaved (one step of each variant in turn) so machine
noise hits all alike. The plain trainer's micro-batches are rows in batch order; a group's are
length-grouped (``flash.train.microbatch``), so part of any difference is padding saved. Reported: median tokens/s (real, unpadded tokens of the batch per second of
``train_step`` as the controller sees it) and the median per-repeat ratio to the plain trainer.
On a 2-core CPU machine a second rank mostly buys memory (1/N of weights, grads and AdamW state per
rank), not speed: both ranks share the same cores and add gloo traffic. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import ray
import torch


def make_batch(rows: int, vocab: int, seed: int = 0):
    """Rows like the default recipe's: prompt 12-28 tokens, response 4-48 with a long tail."""
    from flash.buffers import Sample
    from flash.train.batch import collate

    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(rows):
        p = torch.randint(4, vocab, (int(torch.randint(12, 29, (1,), generator=g)),), generator=g).tolist()
        n = min(48, 4 + int(-10.0 * torch.log1p(-torch.rand(1, generator=g))))  # exponential, mean 10
        r = torch.randint(4, vocab, (n,), generator=g).tolist()
        samples.append(
            Sample(
                prompt_id=i // 8,
                sample_index=i % 8,
                prompt_ids=p,
                response_ids=r,
                behav_logprobs=[-2.0] * n,
                versions=[0] * n,
                reward=float(i % 3 == 0),
            )
        )
    batch = collate(samples)
    adv = torch.randn(batch.mask.shape, generator=g) * batch.mask
    return batch, adv


def build_model_dir(hidden: int, layers: int) -> str:
    from flash.models import TinyModelConfig, build_tiny_model, build_tokenizer

    tok = build_tokenizer()
    heads = max(1, hidden // 32)
    model = build_tiny_model(
        tok,
        TinyModelConfig(
            hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=heads, intermediate_size=3 * hidden
        ),
    )
    path = tempfile.mkdtemp(prefix="flash-bench-trainer-")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def start_variants(path: str, threads: int, names: list[str]) -> dict:
    from flash.train.fsdp import GroupSettings
    from flash.train.trainer import TrainerSettings
    from flash.train.trainer_group import start_trainer_group
    from flash.cluster import wait_ready
    from flash.train.worker import start_trainer

    s = TrainerSettings(
        lr=1e-5,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        grad_clip=1.0,
        micro_batch_size=64,
        temperature=1.0,
        loss={"name": "decoupled_ppo"},
        agg="token-mean",
    )
    variants = {"plain": start_trainer(path, s, 0, threads, [])}  # the ratios' denominator
    for name in names:
        workers, _, budget = name.removeprefix("fsdp").partition("_micro")
        group = GroupSettings(workers=int(workers), micro_tokens=int(budget or 0))
        variants[name] = start_trainer_group(path, s, group, 0, threads, [])
    wait_ready(*variants.values(), timeout=900)
    return variants


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument(
        "--groups",
        default="fsdp1,fsdp2",
        help="FSDP2 variants beside the plain trainer: fsdpN[_microT] (N ranks, T-token budget)",
    )
    args = ap.parse_args(argv)
    from flash.cluster import init_ray

    init_ray(None, num_cpus=os.cpu_count() or 2)
    path = build_model_dir(args.hidden, args.layers)
    batch, adv = make_batch(args.rows, vocab=40)
    tokens = float(batch.attention_mask.sum())
    variants = start_variants(path, args.threads, args.groups.split(","))
    for handle in variants.values():  # warm-up step: first-touch allocations, AdamW state
        ray.get(handle.train_step.remote(batch, adv, None))
    seconds: dict[str, list[float]] = {k: [] for k in variants}
    for rep in range(args.repeats):
        for name, handle in variants.items():
            start = time.monotonic()
            ray.get(handle.train_step.remote(batch, adv, None))
            seconds[name].append(time.monotonic() - start)
        print(f"repeat {rep}: " + ", ".join(f"{k} {tokens / v[-1]:.0f} tok/s" for k, v in seconds.items()), flush=True)
    result = {
        "rows": args.rows,
        "tokens_per_batch": tokens,
        "threads_total": args.threads,
        "hidden": args.hidden,
        "layers": args.layers,
        "repeats": args.repeats,
        "variants": {},
    }
    for name, secs in seconds.items():
        ratios = [p / s for p, s in zip(seconds["plain"], secs, strict=True)]
        result["variants"][name] = {
            "tokens_per_s_median": round(tokens / statistics.median(secs), 1),
            "step_s_median": round(statistics.median(secs), 4),
            "speed_vs_plain_median": round(statistics.median(ratios), 3),
        }
    for handle in variants.values():
        ray.kill(handle)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
