"""Weight sync: SmolLM2-135M-sized weights from a trainer actor to 2 engine replicas, side by side.

    python -m bench.weight_sync [--repeats 5] [--bucket-mb 64] [--layers 30]

A random-init ``LlamaConfig`` with SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads, 3 KV heads,
intermediate 1536, vocab 49152, tied embeddings; 134.5 M parameters, 538 MB in fp32) is saved once;
the trainer (``flash.train.worker.TrainerWorker``) and two real engine replicas
(``flash.engine.torch_worker.EngineWorker``) load it as Ray actors. Per repeat, every method pushes once
(order rotating), after one warm-up push each; the report is the median seconds and the ratio to
``raw_broadcast``. Two phases, to fit a shared 24 GB machine: first ``raw_broadcast`` (full-size
buffers in every member), ``ours_gloo`` and ``ours_shm`` interleaved; then, with those buffers and
the shm segment freed, ``object_store`` (whose transient copies need ~2.6 GB) interleaved with
``ours_gloo`` again. ``object_store``'s ratio is ``object_store / ours_gloo`` of its phase times
``ours_gloo / raw_broadcast``; if it runs out of memory beside other jobs, that is reported:

- ``raw_broadcast`` (the limit): one gloo broadcast of a pre-flattened buffer holding the same
  bytes as our push (tied weights once), from the trainer to both replicas, nothing else: no
  packing, no copy into parameters, no plan.
- ``ours_gloo``: ``ModelUpdateGroup.push`` over gloo (disaggregated placement): plan, check,
  bucketed broadcast, in-place copy into each replica's live parameters, version after both acks.
- ``ours_shm``: the same push over the colocated shared-memory path (``backend=shm``).
- ``object_store``: the baseline path: ``get_weights`` (a cloned state dict) through Ray's object
  store into each replica's ``update_weights``.

After the timed runs, each method pushes once more after the trainer's weights were perturbed, and
each replica's weights are checked against the trainer's (per tensor: float64 sum, first and last
value), so a fast but wrong push cannot pass (``weights_equal``). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import ray
import torch

from flash.weights.model_update import as_bytes, broadcast, connect, make_group, open_store
from flash.weights.group import ModelUpdateGroup
from flash.cluster import init_ray
from flash.engine.torch_worker import EngineWorker
from flash.train.worker import TrainerWorker

METHODS = ("raw_broadcast", "ours_gloo", "ours_shm", "object_store")
LIMIT_PHASE, NAIVE_PHASE = ("raw_broadcast", "ours_gloo", "ours_shm"), ("object_store", "ours_gloo")
SMOLLM2_135M = dict(
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
)


def digest(state: dict) -> list[list[float]]:
    """Per tensor: float64 sum, first and last value (cheap to ship, fails on any misplaced bucket)."""
    return [
        [float(t.double().sum()), float(t.reshape(-1)[0]), float(t.reshape(-1)[-1])] for _, t in sorted(state.items())
    ]


class RawMember:
    """Bench-only methods: a raw broadcast group of its own, and a digest of the live weights."""

    def raw_open(self) -> int:
        self._raw_store = open_store("127.0.0.1", 120)
        return int(self._raw_store.port)

    def raw_join(self, host: str, port: int, rank: int, world: int, nbytes: int) -> None:
        store = self._raw_store if rank == 0 else connect(host, port, 120)
        self._raw_pg = make_group("gloo", store, "raw", rank, world, 120)
        self._raw_buf = torch.zeros(nbytes, dtype=torch.uint8)
        if rank == 0:  # the same bytes our push sends: the unique tensors end to end
            from flash.weights.model_update import unique_tensors

            at = 0
            for _, t in unique_tensors(self._mu_state()):
                b = as_bytes(t.detach().contiguous())
                self._raw_buf[at : at + b.numel()] = b
                at += b.numel()

    def raw_free(self) -> None:
        self._raw_pg = self._raw_buf = self._raw_store = None

    def raw_broadcast(self) -> int:
        broadcast(self._raw_pg, self._raw_buf).wait()
        return int(self._raw_buf.numel())


class BenchTrainer(TrainerWorker, RawMember):
    def digest(self) -> list:
        return digest(self._mu_state())

    @torch.no_grad()
    def perturb(self, seed: int) -> None:
        """New weights, so that a push that loads nothing cannot pass the digest check."""
        g = torch.Generator().manual_seed(seed)
        for p in self.trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=g), alpha=1e-3)


class BenchEngine(EngineWorker, RawMember):
    def digest(self) -> list:
        return digest(self.loop._engine.model.state_dict())


def build(path: str, layers: int) -> int:
    """Save the random-init model in a child process (its 0.5 GB leaves with it); returns params."""
    code = (
        "import sys, torch; from transformers import LlamaConfig, LlamaForCausalLM; "
        f"torch.manual_seed(0); m = LlamaForCausalLM(LlamaConfig(**{dict(SMOLLM2_135M, num_hidden_layers=layers)!r})); "
        "m.save_pretrained(sys.argv[1]); print(sum(p.numel() for p in m.parameters()))"
    )
    out = subprocess.run(["python", "-c", code, path], check=True, capture_output=True, text=True)
    return int(out.stdout.strip().splitlines()[-1])


def start(path: str):
    from flash.train.trainer import TrainerSettings

    settings = TrainerSettings(
        lr=1e-5,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        grad_clip=1.0,
        micro_batch_size=8,
        temperature=1.0,
        loss={"name": "ppo", "old_policy": "prox"},
        agg="token-mean",
    )
    trainer = ray.remote(BenchTrainer).options(num_cpus=0, max_concurrency=4).remote(path, settings, 0, 1, [])
    engines = [ray.remote(BenchEngine).options(num_cpus=0, max_concurrency=8).remote(path, 4, 0, 1) for _ in range(2)]
    ray.get([trainer.stats.remote()] + [e.stats.remote() for e in engines])
    return trainer, engines


class Runner:
    """One callable per method; each returns (seconds, bytes per replica)."""

    def __init__(self, trainer, engines, bucket_mb: float):
        self.trainer, self.engines = trainer, engines
        self.groups = {
            b: ModelUpdateGroup(trainer, engines, backend=b, bucket_mb=bucket_mb, timeout_s=600)
            for b in ("gloo", "shm", "object_store")
        }
        for g in self.groups.values():
            g.setup()
        self.version = 0

    def open_raw(self) -> None:
        """The raw group and its full-size buffers (allocated only for the phase that uses them)."""
        nbytes = self._plan_bytes()
        port = ray.get(self.trainer.raw_open.remote())
        ray.get(
            [self.trainer.raw_join.remote("127.0.0.1", port, 0, 3, nbytes)]
            + [e.raw_join.remote("127.0.0.1", port, i + 1, 3, nbytes) for i, e in enumerate(self.engines)]
        )

    def _plan_bytes(self) -> int:
        wire = ray.get(self.trainer.mu_plan.remote(self.groups["gloo"].group, 1 << 26))
        return sum(nbytes for _, _, _, _, _, nbytes in wire)  # every unique tensor once, no padding

    def run(self, method: str) -> tuple[float, float]:
        ray.get([e.pause.remote("continue") for e in self.engines])
        start = time.perf_counter()
        if method == "raw_broadcast":
            sent = ray.get([self.trainer.raw_broadcast.remote()] + [e.raw_broadcast.remote() for e in self.engines])[0]
        else:
            self.version += 1
            sent = self.groups[method.removeprefix("ours_")].push(self.version)["model_update/bytes"]
        seconds = time.perf_counter() - start
        ray.get([e.resume.remote() for e in self.engines])
        return seconds, float(sent)

    def verify(self, method: str) -> bool:
        """One more push of ``method`` after new trainer weights; True if every replica got them."""
        self.version += 1
        ray.get(self.trainer.perturb.remote(self.version))
        self.run(method)
        want = ray.get(self.trainer.digest.remote())
        return all(d == want for d in ray.get([e.digest.remote() for e in self.engines]))

    def release(self, methods) -> None:
        """Free what ``methods`` hold (raw buffers, the shm segment) before the next phase."""
        if "raw_broadcast" in methods:
            ray.get([m.raw_free.remote() for m in [self.trainer, *self.engines]])
        if "ours_shm" in methods:
            self.groups["shm"].close()


def measure(runner: Runner, methods: tuple[str, ...], repeats: int) -> tuple[dict, dict]:
    """Seconds per repeat and bytes per push of each method, order rotating, one warm-up each."""
    times: dict[str, list[float]] = {m: [] for m in methods}
    sizes: dict[str, float] = {}
    for m in methods:  # warm-up: buffers allocated, pages touched
        runner.run(m)
    for r in range(repeats):
        for m in methods[r % len(methods) :] + methods[: r % len(methods)]:
            seconds, sizes[m] = runner.run(m)
            times[m].append(seconds)
    return times, sizes


def report_line(m: str, times: list[float], nbytes: float, ratio: float) -> str:
    med = statistics.median(times)
    return (
        f"{m:16s} median {med:7.3f} s  {nbytes / med / 1e9:6.2f} GB/s per replica  x{ratio:.2f} of "
        f"raw_broadcast  (all: {', '.join(f'{t:.3f}' for t in times)})"
    )


def naive_phase(runner: Runner, repeats: int) -> dict:
    """object_store beside ours_gloo (measured first); an OOM of the naive path is reported."""
    try:
        times, sizes = measure(runner, NAIVE_PHASE, repeats)
        return {"times": times, "sizes": sizes, "ok": runner.verify("object_store")}
    except Exception as exc:  # noqa: BLE001 - the naive path may not fit beside other jobs: say so
        return {"error": str(exc).splitlines()[0][:300]}


def naive_report(naive: dict, gloo_ratio: float) -> dict:
    """Print object_store's line; its ratio to raw goes through ours_gloo's (measured in both phases)."""
    if "error" in naive:
        print(f"object_store     failed: {naive['error']}")
        return {"object_store_error": naive["error"]}
    times, sizes = naive["times"], naive["sizes"]
    med = {m: statistics.median(v) for m, v in times.items()}
    ratio = med["object_store"] / med["ours_gloo"] * gloo_ratio
    print(report_line("object_store", times["object_store"], sizes["object_store"], ratio))
    print(
        f"(naive phase: ours_gloo median {med['ours_gloo']:.3f} s; object_store / ours_gloo "
        f"x{med['object_store'] / med['ours_gloo']:.2f})"
    )
    return {
        "median_s": {"object_store": med["object_store"], "ours_gloo_naive_phase": med["ours_gloo"]},
        "ratio": ratio,
        "bytes": sizes["object_store"],
        "weights_equal": naive["ok"],
        "times_s": {"object_store": times["object_store"], "ours_gloo_naive_phase": times["ours_gloo"]},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--layers", type=int, default=30, help="fewer for a quick check (30 = SmolLM2-135M)")
    args = ap.parse_args()
    init_ray(None, num_cpus=2)
    with tempfile.TemporaryDirectory() as tmp:
        params = build(tmp, args.layers)
        trainer, engines = start(tmp)
    runner = Runner(trainer, engines, args.bucket_mb)
    runner.open_raw()
    times, sizes = measure(runner, LIMIT_PHASE, args.repeats)
    correct = {m: runner.verify(m) for m in ("ours_gloo", "ours_shm")}
    runner.release(LIMIT_PHASE)
    med = {m: statistics.median(v) for m, v in times.items()}
    ratio = {m: med[m] / med["raw_broadcast"] for m in LIMIT_PHASE}
    print(
        f"{params / 1e6:.1f} M parameters, {sizes['ours_gloo'] / 1e6:.0f} MB per push, 2 replicas, "
        f"bucket {args.bucket_mb:g} MB, {args.repeats} repeats; load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    for m in LIMIT_PHASE:
        print(report_line(m, times[m], sizes[m], ratio[m]), flush=True)
    second = naive_report(naive_phase(runner, args.repeats), ratio["ours_gloo"])
    med.update(second.get("median_s", {}))
    times.update(second.get("times_s", {}))
    if "ratio" in second:
        ratio["object_store"], sizes["object_store"] = second["ratio"], second["bytes"]
        correct["object_store"] = second["weights_equal"]
    print(
        json.dumps(
            {
                "bench": "weight_sync",
                "params": params,
                "bytes": sizes,
                "replicas": 2,
                "bucket_mb": args.bucket_mb,
                "repeats": args.repeats,
                "median_s": med,
                "ratio_to_raw_broadcast": ratio,
                "times_s": times,
                "weights_equal": correct,
                "object_store_error": second.get("object_store_error"),
                "load1": os.getloadavg()[0],
            }
        )
    )
    for group in runner.groups.values():
        group.close()
    ray.shutdown()


if __name__ == "__main__":
    main()
