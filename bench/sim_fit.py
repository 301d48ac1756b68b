"""Fit the simulator's cost model to this machine: the tiny default-recipe model's real engine and trainer.

    python -m bench.sim_fit [--threads 1,2] [--runs] [--steps 10] [--seed 1] [--out sim_fit.json]

Two fits. Without ``--runs`` (what the ``tiny-cpu-*`` presets hold), isolated micro-benchmarks per
torch thread count (below): the *shape* of each cost. With ``--runs``, the default recipe run for
real, sync (roles on both cores in turn) and at r = 2 (one core each, overlapping, sharing the
cores with the driver and Ray): the *scale*, how many times slower than the preset each role was
in the run (``k_engine``, ``k_train``: ratios of sums over the steps after the first), printed as
the ``sim.eff.*`` overrides that scale the preset. Per aggregate step traces a two-parameter fit
(per iteration and per token) is too noisy on loaded cores to separate the two; one factor is not.
Isolated micro-benchmarks:

- the machine's roofline: fp32 GEMM FLOP/s (a 1024² matmul) and copy bandwidth (64 MB);
- decode: ``TorchEngine`` steps at batch sizes 1..256 (prompts of 20 ids, 40 new tokens, no stop),
  each step timed with its batch and context tokens (medians of 13 consecutive steps: the cores
  are shared); what the roofline leaves is fitted by least squares as ``a + c·batch + d·context`` (``step_overhead_s``, ``seq_overhead_s``,
  ``context_overhead_s``);
- prefill: a step that admits the batch, less the fitted decode step (``prefill_mfu``);
- train: ``Trainer.train_step`` (TOPR, token-mean, micro-batches of 64, as the default recipe) on
  batches of 32..256 rows like the recipe's (median of 3 steps each); ``seconds = u0 + u1·tokens`` gives
  ``train_overhead_s = u0`` and ``train_mfu`` from ``u1``;
- weight push: ``TorchEngine.update_weights`` with the trainer's state dict, in process (the Ray
  transfer of a real run is not in it).

In isolation a decode iteration costs ~3× less than inside a run on the loaded cores (the actor's
loop beside Ray's polling threads, the driver, the other role): the isolated presets alone
predicted a sync run 27% and an r = 2 run 45% fast. Prints each fit and, last, JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the CLI sets it: idle threads do not spin

import torch  # noqa: E402


def roofline() -> tuple[float, float]:
    """(fp32 GEMM FLOP/s, copy bytes/s): the best of a few tries each."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    x = torch.empty(16 << 20)
    y = torch.empty_like(x)
    gemm, copy = [], []
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        gemm.append(2 * 1024**3 / (time.perf_counter() - t))
        t = time.perf_counter()
        y.copy_(x)
        copy.append(2 * x.numel() * 4 / (time.perf_counter() - t))
    return max(gemm), max(copy)


def tiny_model():
    from flash.models import TinyModelConfig, build_tiny_model, build_tokenizer

    tok = build_tokenizer()
    return build_tiny_model(tok, TinyModelConfig()), len(tok)


def decode_points(model, vocab: int, batches: list[int], prompt: int = 20, new: int = 40):
    """[(batch, context tokens, seconds)] of decode steps, and [(batch, admit step seconds)]."""
    from flash.engine.base import GenerationRequest, SamplingParams
    from flash.engine.torch_engine import TorchEngine

    points, admits = [], []
    for b in batches:
        engine = TorchEngine(model, max_num_seqs=b, seed=0)
        for i in range(b):
            ids = [4 + (i + j) % (vocab - 4) for j in range(prompt)]
            engine.add_request(GenerationRequest(f"r{i}", ids, SamplingParams(max_new_tokens=new, seed=i)))
        t = time.perf_counter()
        engine.step()
        admits.append((b, time.perf_counter() - t))
        for k in range(1, new):
            t = time.perf_counter()
            engine.step()
            points.append((b, b * (prompt + k), time.perf_counter() - t))
    return points, admits


def train_points(model, rows_list: list[int], repeats: int = 3):
    """[(tokens, seconds)] of ``train_step`` on batches like the default recipe's."""
    from bench.trainer import make_batch
    from flash.train.trainer import Trainer, TrainerSettings

    s = TrainerSettings(
        lr=1e-5,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        grad_clip=1.0,
        micro_batch_size=64,
        temperature=1.0,
        loss={"name": "topr"},
        agg="token-mean",
    )
    trainer = Trainer(model, s)
    out = []
    for rows in rows_list:
        batch, adv = make_batch(rows, vocab=40, seed=rows)
        trainer.train_step(batch, adv, None)  # warm-up: AdamW state, allocations
        for _ in range(repeats):
            t = time.perf_counter()
            trainer.train_step(batch, adv, None)
            out.append((float(batch.attention_mask.sum()), time.perf_counter() - t))
    return out


def robust(points: list[tuple], chunk: int) -> list[tuple]:
    """Medians of each field over consecutive ``chunk``-sized runs of ``points``: a stall of the
    shared cores in one step moves a median little, a least-squares fit much."""
    runs = [points[i : i + chunk] for i in range(0, len(points), chunk)]
    return [tuple(statistics.median(p[j] for p in run) for j in range(len(run[0]))) for run in runs]


def lstsq(rows: list[list[float]], y: list[float]) -> list[float]:
    sol = torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)[:, None])
    return sol.solution[:, 0].tolist()


def fit(threads: int) -> dict:
    """The ``Gpu`` and ``Efficiency`` numbers of the tiny model on ``threads`` torch threads."""
    from flash.sim import cost

    torch.set_num_threads(threads)
    peak, bw = roofline()
    model, vocab = tiny_model()
    params = float(sum(p.numel() for p in model.parameters()))
    cfg = model.config
    m = cost.Model(
        "tiny-qwen2",
        params,
        cfg.num_hidden_layers,
        cfg.num_key_value_heads,
        cfg.hidden_size // cfg.num_attention_heads,
        bytes_per_param=4,
    )
    bare = cost.CostModel(m, cost.Gpu("cpu", peak, bw), cost.Efficiency(1.0, 1.0, 1.0, 1.0, 0.0, bw, 0.0))
    with torch.no_grad():
        points, admits = decode_points(model.eval(), vocab, [1, 8, 32, 96, 192, 256])
    points = robust(points, 13)  # 39 steps per batch size: 3 medians each
    a, c, d = lstsq(
        [[1.0, b, ctx] for b, ctx, _ in points], [t - cost.decode_step_s(bare, b, ctx) for b, ctx, t in points]
    )
    step = lambda b, ctx: cost.decode_step_s(bare, b, ctx) + a + c * b + d * ctx  # noqa: E731
    prefill = [(b * 20, t - step(b, b * 20)) for b, t in admits if b >= 32]
    prefill_mfu = statistics.median(2 * params * n / (peak * max(t, 1e-6)) for n, t in prefill)
    train = robust(train_points(model.train(), [32, 64, 128, 256]), 3)
    u0, u1 = lstsq([[1.0, n] for n, _ in train], [t for _, t in train])
    start = time.perf_counter()
    from flash.engine.torch_engine import TorchEngine

    TorchEngine(model.eval(), max_num_seqs=1).update_weights(dict(model.state_dict()), 1)
    push = time.perf_counter() - start
    return {
        "threads": threads,
        "params": params,
        "layers": m.layers,
        "kv_heads": m.kv_heads,
        "head_dim": m.head_dim,
        "peak_flops": peak,
        "bytes_per_s": bw,
        "step_overhead_s": max(0.0, a),
        "seq_overhead_s": max(0.0, c),
        "context_overhead_s": max(0.0, d),
        "prefill_mfu": min(1.0, prefill_mfu),
        "train_mfu": min(1.0, 6 * params / (peak * u1)) if u1 > 0 else 1.0,
        "train_overhead_s": max(0.0, u0),
        "sync_s": push,
        "decode_rmse_s": _rmse(points, step),
        "train_points": train,
    }


PRESET_FOR_RATIO = {0: "tiny-cpu-2t", 2: "tiny-cpu-1t"}  # the runner's thread split (resolve_threads)


def run_eff(fit: dict) -> dict[str, float]:
    """``sim.eff`` overrides of the ratio's preset from a ``fit_dir``: its isolated costs (the
    shape: per iteration, per sequence, per context token, per train token) times the run's
    slowdowns ``k_engine`` and ``k_train`` (the scale, contention included)."""
    from flash.sim.cost import preset

    e, ke, kt = preset(PRESET_FOR_RATIO[fit["ratio"]]).eff, fit["k_engine"], fit["k_train"]
    return {
        "step_overhead_s": e.step_overhead_s * ke,
        "seq_overhead_s": e.seq_overhead_s * ke,
        "context_overhead_s": e.context_overhead_s * ke,
        "prefill_mfu": e.prefill_mfu / ke,
        "train_mfu": e.train_mfu / kt,
        "train_overhead_s": e.train_overhead_s * kt,
        "sync_latency_s": fit["sync_s"],
    }


def real_run(ratio: int, steps: int, seed: int, root: str):
    """The directory of a real default-recipe run at ``ratio`` (a CLI process, as a user runs it)."""
    import subprocess
    import sys
    from pathlib import Path

    run_dir = Path(root) / f"r{ratio}"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "flash.app.cli",
            "run",
            "recipes/stutter.yaml",
            f"async_ratio={ratio}",
            f"train.steps={steps}",
            f"seed={seed}",
            f"run_dir={run_dir}",
            "tracking.progress=false",
            "checkpoint.enabled=false",
            "task.eval_size=16",
        ],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )  # the run cleans up its own session (flash._reaper), not ours
    return run_dir


def fit_dir(run_dir, ratio: int) -> dict:
    """How much slower the engine and trainer of a real run were than the ratio's preset predicts
    (ratios of sums over the steps after the first: robust to a noisy step), from its traces: per
    step the decode iterations, tokens generated and trained tokens, each iteration at the step's
    mean batch and context."""
    from pathlib import Path

    from flash.sim import cost

    run_dir = Path(run_dir)
    cm = cost.preset(PRESET_FOR_RATIO[ratio])
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    trained = [
        x for x in map(json.loads, (run_dir / "ledger.jsonl").read_text().splitlines()) if x.get("outcome") == "trained"
    ]
    tokens = {r["step"] - 1: 0 for r in rows}
    for x in trained:
        if x["step"] in tokens:
            tokens[x["step"]] += x["plen"] + x["len"]
    ctx = statistics.fmean(x["plen"] + x["len"] / 2 for x in trained)  # a sequence's mean context
    engine = sum(
        r["rollout/decode_steps"] * cost.decode_step_s(cm, b, b * ctx)
        for r in rows
        if (b := r["rollout/tokens_generated"] / max(1, r["rollout/decode_steps"]))
    )
    train = sum(cost.train_step_s(cm, n, 1) for n in tokens.values())
    return {
        "ratio": ratio,
        "k_engine": sum(r["rollout/busy_s"] for r in rows) / max(engine, 1e-9),
        "k_train": sum(r["train/busy_s"] for r in rows) / max(train, 1e-9),
        "sync_s": statistics.median(r["time/push_weights"] for r in rows),
        "real_s_per_step": statistics.fmean(r["time/step"] for r in rows),
    }


def fit_run(ratio: int, steps: int, seed: int, root: str) -> dict:
    return fit_dir(real_run(ratio, steps, seed, root), ratio)


def _rmse(points, step) -> float:
    return (sum((t - step(b, ctx)) ** 2 for b, ctx, t in points) / len(points)) ** 0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--out", default="")
    ap.add_argument("--runs", action="store_true", help="fit from real runs of the default recipe (sync, r = 2)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if args.runs:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="flash-sim-fit-") as tmp:
            fits = [fit_run(r, args.steps, args.seed, tmp) for r in (0, 2)]
        for f in fits:
            print(
                f"r={f['ratio']}: engine x{f['k_engine']:.2f}, trainer x{f['k_train']:.2f} the isolated "
                f"fit; push {f['sync_s'] * 1e3:.1f} ms; real {f['real_s_per_step']:.3f} s/step",
                flush=True,
            )
            print("  " + " ".join(f"sim.eff.{k}={v:.4g}" for k, v in run_eff(f).items()), flush=True)
        print(json.dumps(fits))
        return
    fits = [fit(int(t)) for t in args.threads.split(",")]
    for f in fits:
        print(
            f"threads {f['threads']}: decode {f['step_overhead_s'] * 1e3:.2f} ms + {f['seq_overhead_s'] * 1e6:.1f} us/seq "
            f"+ {f['context_overhead_s'] * 1e9:.1f} ns/context token (rmse {f['decode_rmse_s'] * 1e3:.2f} ms); "
            f"train {f['train_overhead_s']:.3f} s + MFU {f['train_mfu']:.3f}; push {f['sync_s'] * 1e3:.1f} ms",
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(fits, fh, indent=2)
    print(json.dumps(fits))


if __name__ == "__main__":
    main()
