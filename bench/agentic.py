"""The agentic speed-up: episodes whose environment steps have long-tailed latency, sync vs async,
with and without redundant episodes.

    python -m bench.agentic [--repeats 1] [--steps 6] [--delay 0.15] [--sigma 1.0] [--ratios 0,1,2]
                            [--redundancy 0,2] [key=value ...]

Each setting is a fresh ``flash run corridor`` process (the corridor game, multi-turn) whose every
environment step sleeps a lognormal time (median ``--delay`` s, ``--sigma``: the tail; sleeping,
not computing, so the 2 cores are not what limits: the time is the environment's, as with a remote
tool or simulator). The warm start is built once and cached. Settings run back to back within a
repeat (rotating the order each repeat), so load hits all alike.

Per setting: seconds per train step (the run's train time over its steps, evaluations excluded)
and the speed-up over the synchronous run without redundancy of the same repeat; medians over
repeats. ROLL-Flash reports 2.72x for agentic tasks on GPUs (environment-level asynchronous rollout
plus redundant environment rollouts); the aim here is >= 2x at r = 2. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BASE = [
    "train.prompts_per_step=8",
    "rollout.n=4",
    "task.env_workers=4",
    "eval.every_steps=0",
    "task.eval_size=8",
    "tracking.tensorboard=false",
    "checkpoint.enabled=false",
]


def run_setting(ratio: float, redundancy: int, run_dir: Path, args, extra: list[str]) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "flash.app.cli",
        "run",
        "corridor",
        f"async_ratio={ratio}",
        f"rollout.redundancy={redundancy}",
        f"train.steps={args.steps}",
        f"task.step_delay_s={args.delay}",
        f"task.step_delay_sigma={args.sigma}",
        f"run_dir={run_dir}",
        "tracking.progress=false",
        *BASE,
        *extra,
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--delay", type=float, default=0.15)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--ratios", default="0,1,2")
    p.add_argument("--redundancy", default="0,2")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    settings = [(float(r), int(k)) for k in args.redundancy.split(",") for r in args.ratios.split(",")]
    per_step: dict[tuple, list[float]] = {s: [] for s in settings}
    speedups: dict[tuple, list[float]] = {s: [] for s in settings}
    with tempfile.TemporaryDirectory() as tmp:
        cache = [f"cache_dir={tmp}/cache"]
        for rep in range(args.repeats):
            order = settings[rep % len(settings) :] + settings[: rep % len(settings)]
            got = {s: run_setting(*s, Path(tmp) / f"r{rep}-{s[0]}-{s[1]}", args, cache + args.overrides) for s in order}
            base = got[settings[0]]["seconds_per_step"]
            for s in settings:
                per_step[s].append(got[s]["seconds_per_step"])
                speedups[s].append(base / got[s]["seconds_per_step"])
            print(
                f"repeat {rep}: "
                + ", ".join(f"r={s[0]:g} k={s[1]}: {got[s]['seconds_per_step']:.2f} s/step" for s in settings),
                flush=True,
            )
    rows = {
        f"r={r:g},redundancy={k}": {
            "seconds_per_step": statistics.median(per_step[(r, k)]),
            "speedup": statistics.median(speedups[(r, k)]),
        }
        for r, k in settings
    }
    for name, row in rows.items():
        print(f"{name:<22} {row['seconds_per_step']:7.2f} s/step  speed-up {row['speedup']:.2f}x")
    print(
        json.dumps(
            {
                "delay_s": args.delay,
                "sigma": args.sigma,
                "steps": args.steps,
                "repeats": args.repeats,
                "speedup": {k: round(v["speedup"], 3) for k, v in rows.items()},
                "seconds_per_step": {k: round(v["seconds_per_step"], 3) for k, v in rows.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
