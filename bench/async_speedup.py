"""Async vs sync on the default recipe: time per step and the speedup ratio, measured side by side.

    python -m bench.async_speedup [--repeats 3] [--ratios 0,2] [key=value ...]

Each repeat runs every ratio back to back (interleaved, so machine noise hits both alike) as a
fresh `flash run` process with the same number of steps and samples. Sync (r = 0) is colocated:
each phase may use both cores; async (r > 0) splits the cores between engine and trainer (the
runner's auto thread split). Reports the median seconds per train step and the median of the
per-repeat ratios sync/async, with the per-phase means that say where the time goes. The last line
is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_once(recipe: str, ratio: float, run_dir: Path, overrides: list[str]) -> dict:
    cmd = [sys.executable, "-m", "flash.app.cli", "run", recipe, f"async_ratio={ratio}", f"run_dir={run_dir}",
           "tracking.progress=false", *overrides]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((run_dir / "summary.json").read_text())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="stutter")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ratios", default="0,2")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    ratios = [float(r) for r in args.ratios.split(",")]
    out = Path(tempfile.mkdtemp(prefix="flash-bench-"))
    runs: dict[float, list[dict]] = {r: [] for r in ratios}
    for rep in range(args.repeats):
        for r in ratios:
            s = run_once(args.recipe, r, out / f"r{r}-{rep}", args.overrides)
            runs[r].append(s)
            print(f"repeat {rep} r={r}: {s['seconds_per_step']:.3f} s/step, acc "
                  f"{s['eval_accuracy_initial']:.3f}->{s['eval_accuracy_final']:.3f}, "
                  f"wall {s['wall_seconds']:.0f}s, max staleness {s['max_staleness_observed']:.0f}", flush=True)
    base = ratios[0]
    result = {"recipe": args.recipe, "repeats": args.repeats, "overrides": args.overrides, "per_ratio": {}}
    for r in ratios:
        per_step = [s["seconds_per_step"] for s in runs[r]]
        speedups = [a["seconds_per_step"] / b["seconds_per_step"] for a, b in zip(runs[base], runs[r])]
        phases = {k: statistics.median(s["phase_seconds_mean"].get(k, 0.0) for s in runs[r])
                  for k in runs[r][0]["phase_seconds_mean"]}
        result["per_ratio"][str(r)] = {
            "seconds_per_step_median": statistics.median(per_step),
            "speedup_vs_first_median": statistics.median(speedups),
            "eval_accuracy_final_median": statistics.median(s["eval_accuracy_final"] for s in runs[r]),
            "eval_accuracy_initial": runs[r][0]["eval_accuracy_initial"],
            "wall_seconds_median": statistics.median(s["wall_seconds"] for s in runs[r]),
            "phase_seconds_median": {k: round(v, 4) for k, v in phases.items()},
        }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
