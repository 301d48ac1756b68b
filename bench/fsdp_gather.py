"""The trainer group's gather before a weight push: per-parameter vs one flat gather, side by side.

    python -m bench.fsdp_gather [--repeats 7] [--world 2] [--models default,wide] [--bucket-mib 8]

Two gloo ranks (spawned processes, one torch thread each, as ``TrainerGroup`` splits 2 threads
over 2 ranks) shard a tiny Qwen2 with ``flash.train.fsdp.shard_model``, then gather its full state dict
to rank 0 both ways, alternating which goes first, after one warm-up each:

- ``per_param``: what ``FSDPRank.mu_gather`` did, ``get_model_state_dict(full_state_dict=True,
  cpu_offload=True)``: one all-gather per parameter, a CPU copy on every rank.
- ``flat``: ``flash.weights.gather.FlatGather`` (planned once, as at the group's setup): every rank's
  shards packed into one buffer per dtype bucket of ``--bucket-mib``, one ``dist.gather`` each to
  rank 0 (two buckets in flight), unpacked there only.

A call is timed on rank 0 from a barrier to its return. Models: ``default`` is the default
recipe's (hidden 128, 4 layers, ~1.7 MB fp32), ``wide`` a bigger one (hidden 512, 4 layers, tens
of MB). Before timing, the two results are checked equal tensor for tensor. Reported per model:
median seconds each way and the median of per-repeat ratios ``per_param / flat``. Last line JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

MODELS = {
    "default": {},
    "wide": {"hidden_size": 512, "num_layers": 4, "num_heads": 8, "num_kv_heads": 8, "intermediate_size": 1536},
}


def build(name: str):
    from flash.models import TinyModelConfig, build_tiny_model, build_tokenizer

    return build_tiny_model(build_tokenizer(), TinyModelConfig(**MODELS[name]))


def per_param(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def flat_way(model, bucket_mib: float):
    """``FSDPRank.mu_gather``'s way now: a plan made once, then a gather per push."""
    from flash.weights.gather import FlatGather

    plan = FlatGather(model, bucket_bytes=int(bucket_mib * (1 << 20)))
    return lambda m: plan(dst=0)


def timed(fn, model) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn(model)
    return time.perf_counter() - start


def bench_model(name: str, repeats: int, rank: int, bucket_mib: float) -> dict | None:
    """Both ways, alternating, on one sharded model; rank 0's summary (None on other ranks)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from flash.train.fsdp import shard_model

    model = build(name)
    shard_model(model, init_device_mesh("cpu", (dist.get_world_size(),)))
    flat = flat_way(model, bucket_mib)
    a, b = per_param(model), flat(model)  # warm-up, and the check
    if rank == 0:
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a), name
    ways = {"per_param": per_param, "flat": flat}
    times: dict[str, list[float]] = {k: [] for k in ways}
    for i in range(repeats):
        order = list(ways) if i % 2 == 0 else list(ways)[::-1]
        for way in order:
            times[way].append(timed(ways[way], model))
    if rank != 0:
        return None
    mb = sum(t.numel() * t.element_size() for t in {id(t): t for t in b.values()}.values()) / 1e6  # tied: once
    ratios = [p / f for p, f in zip(times["per_param"], times["flat"], strict=True)]
    return {
        "model": name,
        "state_mb": round(mb, 2),
        "tensors": len(b),
        "bucket_mib": bucket_mib,
        **{f"{k}_s": round(statistics.median(v), 5) for k, v in times.items()},
        "ratio_median": round(statistics.median(ratios), 2),
        "ratios": [round(r, 2) for r in ratios],
    }


def rank_main(rank: int, world: int, port: int, models: list[str], repeats: int, bucket_mib: float, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = [bench_model(m, repeats, rank, bucket_mib) for m in models]
        dist.barrier()  # no rank leaves the group while a peer may still be in a collective
        if rank == 0:
            with open(out, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def main() -> None:
    import tempfile

    import torch.multiprocessing as mp

    from flash.train.fsdp import free_port
    from flash.weights.gather import BUCKET_BYTES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--models", default="default,wide")
    ap.add_argument(
        "--bucket-mib", type=float, default=BUCKET_BYTES / (1 << 20), help="gathered MiB per collective (flat)"
    )
    args = ap.parse_args()
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(
            rank_main, args=(args.world, free_port(), models, args.repeats, args.bucket_mib, out), nprocs=args.world
        )
        with open(out) as f:
            results = json.load(f)
    for r in results:
        print(
            f"{r['model']:8s} {r['state_mb']:7.2f} MB {r['tensors']:3d} tensors  per_param {r['per_param_s']:.4f} s  "
            f"flat {r['flat_s']:.4f} s  per_param/flat {r['ratio_median']:.2f}x"
        )
    print(json.dumps({"world": args.world, "repeats": args.repeats, "results": results}))


if __name__ == "__main__":
    main()
