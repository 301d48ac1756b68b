"""What several optimizer steps per batch and the approximate proximal policy cost, side by side.

    python -m bench.offpolicy_steps [--repeats 2] [--steps 20] [key=value ...]

Variants of the default recipe at async ratio 2, each a fresh `flash run` process with the same
seed, steps and samples, run back to back within each repeat (interleaved, so machine noise hits
all alike):

    mb1           one optimizer step per batch, prox fused into the train forward (the default)
    mb4           ``train.mini_batches=4``: four steps per batch, prox taken once at its start
    always        ``algo.recompute_prox=always``: prox from a forward of its own
    approx        ``algo.recompute_prox=approx algo.measure_prox_error=true``: no prox forward
                  (AReaL's interpolation by version), the real recompute run beside it only to
                  measure the approximation's logprob error

Reported per variant: median trainer seconds per step (``time/recompute_prox`` + ``time/train``,
the trainer's share of a step), its per-repeat ratio to ``mb1``, seconds per step, and for
``approx`` the mean |approx − recomputed| logprob error (``rollout/prox_approx_error``). With
``measure_prox_error`` the approx run pays for the recompute too, so its time is reported without
the ``recompute_prox`` phase. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {
    "mb1": [],
    "mb4": ["train.mini_batches=4"],
    "always": ["algo.recompute_prox=always"],
    "approx": ["algo.recompute_prox=approx", "algo.measure_prox_error=true"],
}


def run_variant(name: str, run_dir: Path, steps: int, extra: list[str]) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "flash.app.cli",
        "run",
        "stutter",
        f"run_dir={run_dir}",
        f"train.steps={steps}",
        "tracking.progress=false",
        "tracking.tensorboard=false",
        "checkpoint.every_steps=0",
        "algo.loss.name=decoupled_ppo",  # the loss that reads the proximal policy these variants vary
        *VARIANTS[name],
        *extra,
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def trainer_seconds(name: str, m: dict) -> float:
    """The trainer's seconds in one step (the approx run's measuring recompute left out)."""
    prox = 0.0 if name == "approx" else m.get("time/recompute_prox", 0.0)
    return prox + m.get("time/train", 0.0)


def summarize(runs: dict[str, list[list[dict]]]) -> dict[str, dict]:
    """Per variant, over repeats: medians of the per-run median step figures, and ratios to mb1
    paired by repeat."""

    def med(rows: list[dict], f) -> float:
        return statistics.median(f(m) for m in rows[1:] or rows)  # the first step also warms up

    out = {}
    for name, reps in runs.items():
        train = [med(rows, lambda m, n=name: trainer_seconds(n, m)) for rows in reps]
        base = [med(rows, lambda m: trainer_seconds("mb1", m)) for rows in runs["mb1"]]
        out[name] = {
            "trainer_seconds_per_step": statistics.median(train),
            "trainer_ratio_to_mb1": statistics.median(a / b for a, b in zip(train, base)),
            "seconds_per_step": statistics.median(med(rows, lambda m: m["time/step"]) for rows in reps),
            "optimizer_steps": reps[0][-1].get("train/optimizer_steps", 1.0),
        }
        errors = [m["rollout/prox_approx_error"] for rows in reps for m in rows if "rollout/prox_approx_error" in m]
        if errors:
            out[name]["prox_approx_error_mean"] = statistics.fmean(errors)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("overrides", nargs="*", help="key=value for every variant")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="flash-bench-offpolicy-"))
    runs: dict[str, list[list[dict]]] = {name: [] for name in VARIANTS}
    for rep in range(args.repeats):
        for name in VARIANTS:
            runs[name].append(run_variant(name, root / f"{name}-{rep}", args.steps, args.overrides))
    out = summarize(runs)
    for name, row in out.items():
        err = f", approx logprob error {row['prox_approx_error_mean']:.4f}" if "prox_approx_error_mean" in row else ""
        print(
            f"{name}: trainer {row['trainer_seconds_per_step']:.3f} s/step ({row['trainer_ratio_to_mb1']:.2f}x mb1), "
            f"step {row['seconds_per_step']:.3f} s, {row['optimizer_steps']:.0f} optimizer steps/batch{err}"
        )
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
