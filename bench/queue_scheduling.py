"""Queue scheduling vs batch-then-score with a slow reward: time per step and the ratio, side by side.

    python -m bench.queue_scheduling [--repeats 3] [--recipe stutter|code] [key=value ...]

On the default recipe (``--recipe stutter``) the reward is made slow with
``rollout.inject_delay_s=X``: every response waits uniform(0, X) seconds before it is scored (an
I/O-bound reward: a sandbox service, a judge). On ``--recipe code`` the reward is real CPU work:
each response runs its hidden tests in a fresh sandbox (``flash.rewards.sandbox``, through the
reward workers), nothing injected. Each repeat runs both modes back to back (interleaved, so
machine noise hits both alike) as fresh ``flash run`` processes with the same seed, steps and
samples (the first run builds the warm start: ``task.eval_size`` is part of its cache key):

- ``rollout.queue_scheduling=true``: each response is scored as soon as it finishes, while the
  rest of the batch still decodes;
- ``rollout.queue_scheduling=false``: a wave's responses are scored only after the whole wave
  finished generating (the batch-then-score loop).

Reports median seconds per train step per mode, the median of the per-repeat ratios
batch/queue (> 1: queue scheduling is faster) of the step time and of the ``get_batch`` phase (the
time the trainer waited for rollout and reward: the part scheduling can change; queue scheduling
can save at most min(generation, reward) seconds of it per step), and the summed reward seconds.
The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Synchronous so that rollout and reward sit on the critical path; a small held-out set (the bench
# times steps, not accuracy).
COMMON = ["async_ratio=0", "train.steps=6", "task.eval_size=16", "tracking.tensorboard=false"]
# Per recipe. stutter: its batch (16 prompts x 8 samples); a response waits 25 ms on average in
# the reward pool of 4 (0.8 s of reward time per step, about as long as generating the batch on 2
# loaded cores). code: its own batch and reward (one sandbox process per response).
RECIPE_DEFAULTS = {
    "stutter": ["train.prompts_per_step=16", "rollout.n=8", "rollout.inject_delay_s=0.05", "rollout.reward_workers=4"],
    "code": [],
}
MODES = {"queue": "true", "batch": "false"}


def defaults(recipe: str) -> list[str]:
    return [*COMMON, *RECIPE_DEFAULTS.get(recipe, [])]


def run_once(recipe: str, mode: str, run_dir: Path, overrides: list[str], retries: int = 1) -> dict:
    """One ``flash run``; retried once if it fails (on a loaded shared machine a local Ray can time
    out starting), the failure printed so it is not hidden."""
    cmd = [
        sys.executable,
        "-m",
        "flash.app.cli",
        "run",
        recipe,
        *defaults(recipe),
        *overrides,
        f"rollout.queue_scheduling={MODES[mode]}",
        f"run_dir={run_dir}",
        "tracking.progress=false",
    ]
    for attempt in range(retries + 1):
        proc = subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode == 0:
            return json.loads((run_dir / "summary.json").read_text())
        last = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        print(f"{mode} run failed (attempt {attempt + 1}, rc {proc.returncode}): {last}", flush=True)
    raise RuntimeError(f"{mode} run failed {retries + 1} times: {' '.join(cmd)}")


def summarize(runs: dict[str, list[dict]]) -> dict:
    ratios = [b["seconds_per_step"] / q["seconds_per_step"] for q, b in zip(runs["queue"], runs["batch"])]
    waits = [
        b["phase_seconds_mean"]["get_batch"] / q["phase_seconds_mean"]["get_batch"]
        for q, b in zip(runs["queue"], runs["batch"])
    ]
    out = {
        "batch_over_queue_step_time_median": statistics.median(ratios),
        "batch_over_queue_step_time": [round(x, 3) for x in ratios],
        # get_batch: the trainer waiting for rollout + reward, the part scheduling can change
        "batch_over_queue_get_batch_median": statistics.median(waits),
        "batch_over_queue_get_batch": [round(x, 3) for x in waits],
    }
    for mode, rs in runs.items():
        out[mode] = {
            "seconds_per_step_median": statistics.median(s["seconds_per_step"] for s in rs),
            "seconds_per_step": [round(s["seconds_per_step"], 3) for s in rs],
            "get_batch_seconds_median": statistics.median(s["phase_seconds_mean"]["get_batch"] for s in rs),
            "train_seconds_median": statistics.median(s["phase_seconds_mean"]["train"] for s in rs),
            "reward_seconds_per_step_median": statistics.median(
                s.get("reward_seconds", 0.0) / max(s["steps"], 1) for s in rs
            ),
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="stutter")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    out = Path(tempfile.mkdtemp(prefix="flash-bench-queue-"))
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    start = time.monotonic()
    for rep in range(args.repeats):
        for mode in MODES:
            s = run_once(args.recipe, mode, out / f"{mode}-{rep}", args.overrides)
            runs[mode].append(s)
            print(
                f"repeat {rep} {mode}: {s['seconds_per_step']:.3f} s/step, get_batch "
                f"{s['phase_seconds_mean']['get_batch']:.3f} s, reward {s.get('reward_seconds', 0):.1f} s total",
                flush=True,
            )
    result = {
        "bench": "queue_scheduling",
        "recipe": args.recipe,
        "repeats": args.repeats,
        "overrides": [*defaults(args.recipe), *args.overrides],
        "wall_seconds": round(time.monotonic() - start, 1),
        **summarize(runs),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
