"""Async vs sync on the default recipe: time per step and the speedup ratio, measured side by side.

    python -m bench.async_speedup [--repeats 3] [--seeds 0,1,2] [--ratios 0,2] [key=value ...]

A *pair* is one repeat (with ``--seeds``: one repeat of one seed). Each pair runs every ratio back to
back (interleaved, so machine noise hits both alike) as a fresh `flash run` process with the same
number of steps and samples and the same seed. Sync (r = 0) is colocated: each phase may use both
cores; async (r > 0) splits the cores between engine and trainer (the runner's auto thread split).

Reports per ratio, over the pairs: seconds per train step, the speed-up over the first ratio taken
*within each pair* (sync s/step over async s/step of the runs made side by side, never a ratio of
means) and the final held-out accuracy, each as the median and as mean ± standard error (SE = sample
std / √n; none for n = 1), with the per-phase medians that say where the time goes. The last line
is JSON: the ``*_median`` keys as before, ``*_mean`` / ``*_se`` beside them, each pair's ratio in
``speedup_vs_first_per_pair``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from flash.app.replicates import Stat, fmt_stat, spread


def run_once(recipe: str, ratio: float, run_dir: Path, overrides: list[str]) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "flash.app.cli",
        "run",
        recipe,
        f"async_ratio={ratio}",
        f"run_dir={run_dir}",
        "tracking.progress=false",
        *overrides,
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((run_dir / "summary.json").read_text())


def summarize(runs: dict[float, list[dict]]) -> dict[str, dict]:
    """Per ratio (keys in order, the first the baseline), from each pair's ``summary.json``: the
    ``i``-th summary of every ratio is the same pair, so speed-ups are the per-pair ratios."""
    base = next(iter(runs))
    out = {}
    for r, rs in runs.items():
        per_step = spread([s["seconds_per_step"] for s in rs])
        ratios = [a["seconds_per_step"] / b["seconds_per_step"] for a, b in zip(runs[base], rs)]
        speedup = spread(ratios)
        acc = spread([s["eval_accuracy_final"] for s in rs])
        phases = {
            k: statistics.median(s["phase_seconds_mean"].get(k, 0.0) for s in rs)
            for k in rs[0].get("phase_seconds_mean", {})
        }
        out[str(r)] = {
            "n_pairs": len(rs),
            **{f"seconds_per_step_{k}": per_step[k] for k in ("median", "mean", "se")},
            **{f"speedup_vs_first_{k}": speedup[k] for k in ("median", "mean", "se")},
            "speedup_vs_first_per_pair": [round(x, 4) for x in ratios],
            **{f"eval_accuracy_final_{k}": acc[k] for k in ("median", "mean", "se")},
            "eval_accuracy_initial": rs[0]["eval_accuracy_initial"],
            "wall_seconds_median": statistics.median(s["wall_seconds"] for s in rs),
            "phase_seconds_median": {k: round(v, 4) for k, v in phases.items()},
        }
    return out


def report_line(ratio: str, base: str, row: dict) -> str:
    """One human line per ratio: mean ± SE (and median) of s/step, paired speed-up and accuracy."""

    def stat(key: str, spec: str) -> str:
        return fmt_stat(Stat(row[f"{key}_mean"], row[f"{key}_se"], row["n_pairs"]), spec)

    pairs = ", ".join(f"{x:.2f}" for x in row["speedup_vs_first_per_pair"])
    return (
        f"r={ratio} (n={row['n_pairs']}): {stat('seconds_per_step', '.3f')} s/step (median "
        f"{row['seconds_per_step_median']:.3f}), speed-up vs r={base} {stat('speedup_vs_first', '.2f')}x "
        f"(median {row['speedup_vs_first_median']:.2f}x; per pair {pairs}), "
        f"final acc {stat('eval_accuracy_final', '.3f')}"
    )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="stutter")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seeds", default="", help="seeds to run each repeat with, e.g. 0,1,2 (default: the recipe's)")
    ap.add_argument("--ratios", default="0,2")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    ratios = [float(r) for r in args.ratios.split(",")]
    seeds = [int(s) for s in args.seeds.split(",") if s] or [None]
    out = Path(tempfile.mkdtemp(prefix="flash-bench-"))
    runs: dict[float, list[dict]] = {r: [] for r in ratios}
    for rep in range(args.repeats):
        for seed in seeds:
            extra = [] if seed is None else [f"seed={seed}"]
            for r in ratios:
                s = run_once(args.recipe, r, out / f"r{r}-{rep}-s{seed}", [*args.overrides, *extra])
                runs[r].append(s)
                print(
                    f"repeat {rep} seed {seed} r={r}: {s['seconds_per_step']:.3f} s/step, acc "
                    f"{s['eval_accuracy_initial']:.3f}->{s['eval_accuracy_final']:.3f}, "
                    f"wall {s['wall_seconds']:.0f}s, max staleness {s['max_staleness_observed']:.0f}",
                    flush=True,
                )
    per_ratio = summarize(runs)
    for r in ratios:
        print(report_line(str(r), str(ratios[0]), per_ratio[str(r)]), flush=True)
    result = {
        "recipe": args.recipe,
        "repeats": args.repeats,
        "seeds": seeds,
        "overrides": args.overrides,
        "per_ratio": per_ratio,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
