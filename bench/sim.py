"""Simulated seconds per step, sync vs async, at 64 and 1024 simulated H100s (recipes/sim_rlvr.yaml;
``--recipe sim_agentic``: multi-turn episodes with environment latency, ``--redundancy 0,2``: with
redundant episodes too).

    python -m bench.sim [--recipe sim_rlvr] [--gpus 64,1024] [--ratios 0,1,2] [--redundancy 0]
                        [--steps 5] [key=value ...]

Each (GPUs, ratio) is one in-process run of the real controller, scheduler and buffer against the
simulated engine and trainer (one Ray for all runs). GPUs are split half rollout, half training;
the batch grows with the GPUs (``prompts_per_step`` = GPUs, so each engine instance holds the same
load at every scale). Reports per run: simulated seconds per step (the mean over the steps after
the first ``1 + ceil(ratio)``: the first holds the start-up, and at ratio r the scheduler admits
(1 + r) batches at once, so the next r steps take batches made before the cycle reached its
steady state -- keep ``--steps`` well above that), the speed-up over the first ratio at the same GPUs, the
real wall seconds a step took (what one simulated step costs here). Simulated seconds are GPU
time scaled back plus the driver's real time unscaled (``flash.sim.accounting``); ``driver`` is
that unscaled share, ``scaled`` the plain division of the wall time by ``sim.time_scale`` (which
scales the driver's real work up as if it were GPU time). The last line is JSON.

``sim.time_scale`` (unless given) grows with the GPUs: the simulated engine draws every in-flight
sequence's tokens in one process, and once that bookkeeping takes longer than a step's scaled GPU
time the engine falls behind in real time (async runs at 1024 GPUs hold ~24k sequences at once
and read ~25% slow at 0.05). 0.05 up to 256 GPUs, 0.2 above.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from flash.app.config import load_config
from flash.app.plan_sim import sim_skip
from flash.app.runner import run


def time_scale_for(gpus: int) -> float:
    """Real seconds per simulated second at ``gpus`` (see the module doc)."""
    return 0.05 if gpus <= 256 else 0.2


def one_run(gpus: int, ratio: float, redundancy: int, steps: int, root: Path, args) -> dict:
    half = gpus // 2
    cfg = load_config(
        f"recipes/{args.recipe}.yaml",
        [
            f"sim.time_scale={time_scale_for(gpus)}",
            f"async_ratio={ratio}",
            f"rollout.redundancy={redundancy}",
            f"train.steps={steps}",
            f"sim.rollout_gpus={half}",
            f"sim.train_gpus={half}",
            f"train.prompts_per_step={gpus}",
            f"run_dir={root / f'g{gpus}-r{ratio}-k{redundancy}'}",
            "tracking.progress=false",
            "checkpoint.enabled=false",
            *args.overrides,
        ],
    )
    start = time.monotonic()
    summary = run(cfg, "sim")
    wall = time.monotonic() - start
    rows = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    later = rows[sim_skip(ratio) :] or rows
    mean = {
        k: sum(r.get(k, 0.0) for r in later) / len(later)
        for k in ("sim/step_s", "sim/step_scaled_s", "sim/driver_s", "time/step", "rollout/sim_late_s")
    }
    return {
        "gpus": gpus,
        "ratio": ratio,
        "redundancy": redundancy,
        "sim_s_per_step": mean["sim/step_s"],
        "wall_s_per_step": mean["time/step"],
        "scaled_s_per_step": mean["sim/step_scaled_s"],
        "driver_s_per_step": mean["sim/driver_s"],
        "run_wall_s": wall,
        "late_s_per_step": mean["rollout/sim_late_s"],
        "max_staleness": summary["max_staleness_observed"],
        "time_scale": cfg.sim.time_scale,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="sim_rlvr")
    ap.add_argument("--gpus", default="64,1024")
    ap.add_argument("--redundancy", default="0")
    ap.add_argument("--ratios", default="0,1,2")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="flash-bench-sim-") as tmp:
        for gpus in [int(g) for g in args.gpus.split(",")]:
            base = None
            settings = [(float(r), int(k)) for k in args.redundancy.split(",") for r in args.ratios.split(",")]
            for ratio, redundancy in settings:
                r = one_run(gpus, ratio, redundancy, args.steps, Path(tmp), args)
                base = base or r["sim_s_per_step"]
                r["speedup_vs_first"] = base / r["sim_s_per_step"]
                results.append(r)
                print(
                    f"{gpus:5d} GPUs  r={ratio:<4g} k={redundancy} {r['sim_s_per_step']:8.1f} sim s/step  "
                    f"x{r['speedup_vs_first']:.2f}  (driver {r['driver_s_per_step']:.1f} s, "
                    f"scaled {r['scaled_s_per_step']:.1f})  wall {r['wall_s_per_step']:.2f} s/step "
                    f"(run {r['run_wall_s']:.0f} s, engine late {r['late_s_per_step']:.2f} s)  "
                    f"staleness max {r['max_staleness']:.0f}",
                    flush=True,
                )
    print(json.dumps({"runs": results}))


if __name__ == "__main__":
    main()
