"""What durability costs: checkpoint size, write time and step-time cost; engine-death recovery time.

    python -m bench.durability [--repeats 3] [--steps 12] [--no-fault] [key=value ...]
    python -m bench.durability --reward-only [--repeats 5]

Part 1, side by side in one run (interleaved repeats, so machine noise hits all alike), the same
recipe as fresh `flash run` processes with checkpoints ``off``, written every step in the step
(``sync``: ``checkpoint.async_write=false``) and every step in a background thread (``async``).
Reported: the median wall seconds per step (the first step left out) and its ratio to ``off``,
the median checkpoint size, write seconds and in-step snapshot seconds.

Part 2, per repeat: a run (async ratio 2) whose engine process is SIGKILLed after a third of the
steps. Reported (medians): the supervisor's recovery (restart + weight push + requeue), the time
from the kill until the engine answers again with its work requeued, and the time from the kill
to full throughput: the start of the first step window after the kill whose generated tokens/s is
at least 90% of the median before the kill.

Part 3 (``--reward-only`` runs just this; cheap, no training): a ``RewardPool`` of 2 workers
scoring a steady stream of 0.5 s calls; one worker is SIGKILLed inside a call. Reported (medians):
kill → scoring again on the replacement (the first call that starts in the new process, timed by a
marker file the reward writes as it starts: the killed calls are issued again then), and the
pool's own replacement time (failed call → new worker ready).
The last line is JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = {
    "off": ["checkpoint.enabled=false"],
    "sync": ["checkpoint.every_steps=1", "checkpoint.async_write=false"],
    "async": ["checkpoint.every_steps=1", "checkpoint.async_write=true"],
}


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def start(recipe: str, run_dir: Path, overrides: list[str]) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "flash.app.cli",
        "run",
        recipe,
        f"run_dir={run_dir}",
        "tracking.progress=false",
        *overrides,
    ]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def step_walls(metrics: list[dict]) -> list[float]:
    ends = [m["time/elapsed"] for m in metrics]
    return [b - a for a, b in itertools.pairwise(ends)]  # step 1 left out (it opens the windows)


def checkpoint_run(recipe: str, mode: str, run_dir: Path, overrides: list[str]) -> dict:
    proc = start(recipe, run_dir, [*MODES[mode], *overrides])
    if proc.wait() != 0:
        raise RuntimeError(f"run {run_dir} failed")
    metrics = jsonl(run_dir / "metrics.jsonl")
    writes = [m["checkpoint/write_s"] for m in metrics if "checkpoint/write_s" in m]
    snaps = [m["checkpoint/snapshot_s"] for m in metrics if "checkpoint/snapshot_s" in m]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "step_s": statistics.median(step_walls(metrics)),
        "write_s": statistics.median(writes) if writes else 0.0,
        "snapshot_s": statistics.median(snaps) if snaps else 0.0,
        "bytes": summary["checkpoint"].get("bytes", 0.0),
    }


def fault_run(recipe: str, run_dir: Path, steps: int, overrides: list[str]) -> dict:
    proc = start(recipe, run_dir, ["async_ratio=2", "checkpoint.every_steps=0", *overrides])
    kill_after = max(2, steps // 3)
    while len(jsonl(run_dir / "metrics.jsonl")) < kill_after:
        if proc.poll() is not None:
            raise RuntimeError(f"run {run_dir} ended early")
        time.sleep(0.05)
    pid = next(e for e in jsonl(run_dir / "events.jsonl") if e["event"] == "roles_ready")["engine_pid"]
    killed = time.time()
    os.kill(pid, signal.SIGKILL)
    if proc.wait() != 0:
        raise RuntimeError(f"run {run_dir} failed after the engine was killed")
    fault = next(e for e in jsonl(run_dir / "events.jsonl") if e["event"] == "engine_fault")
    return {
        "recovery_s": fault["recovery_s"],
        "kill_to_recovered_s": fault["time"] + fault["recovery_s"] - killed,
        "kill_to_full_throughput_s": time_to_full(run_dir, killed),
    }


def time_to_full(run_dir: Path, killed: float, share: float = 0.9) -> float:
    """Kill → start of the first step window after it generating >= ``share`` of the old rate."""
    metrics, timeline = jsonl(run_dir / "metrics.jsonl"), jsonl(run_dir / "timeline.jsonl")
    ends = [max(span[1] for span in t["phases"].values()) for t in timeline]
    windows = [(ends[i - 1], ends[i], metrics[i]["rollout/tokens_generated"]) for i in range(1, len(ends))]
    before = [tok / (b - a) for a, b, tok in windows if b <= killed]
    base = statistics.median(before[1:] or before)
    for a, b, tok in windows:
        if a >= killed and tok / (b - a) >= share * base:
            return a - killed
    return float("nan")


def marked_reward(item, response, mark_dir: str = "", seconds: float = 0.5):
    """A reward taking ``seconds``; a file ``<pid>-<start ns>`` in ``mark_dir`` per call started."""
    open(os.path.join(mark_dir, f"{os.getpid()}-{time.time_ns()}"), "w").close()
    time.sleep(seconds)
    return 1.0


def reward_fault_run(calls: int = 24, seconds: float = 0.5) -> dict:
    """One pool, one worker killed mid-call; times to running and to scoring its call again."""
    from concurrent.futures import ThreadPoolExecutor

    from flash.rewards.workers import RewardPool
    from flash.tasks import TaskItem

    marks = Path(tempfile.mkdtemp(prefix="flash-bench-reward-"))
    pool = RewardPool(
        {"name": "bench.durability:marked_reward", "mark_dir": str(marks), "seconds": seconds},
        num_workers=2,
        concurrency=2,
        timeout_s=60,
    )
    try:
        pids = set(pool.pids())
        done: list[float] = []
        with ThreadPoolExecutor(4) as ex:
            futures = [
                ex.submit(lambda i=i: (pool.score(TaskItem(i, "p", ""), "x"), done.append(time.time())))
                for i in range(calls)
            ]
            while len(list(marks.iterdir())) < 4:  # both workers busy
                time.sleep(0.01)
            victim = int(max(marks.iterdir(), key=lambda p: int(p.name.split("-")[1])).name.split("-")[0])
            killed = time.time()
            os.kill(victim, signal.SIGKILL)
            for f in futures:
                f.result(timeout=600)
        fresh = [int(p.name.split("-")[1]) / 1e9 for p in marks.iterdir() if int(p.name.split("-")[0]) not in pids]
        event = pool.events[0]
        return {
            "kill_to_call_running_again_s": min(fresh) - killed,
            "replacement_s": event["recovery_s"],
            "faults": pool.faults,
            "reissued": pool.counters["reissued"],
            "calls_ok": len(done),
        }
    finally:
        pool.close()


def reward_only(repeats: int) -> dict:
    from flash.cluster import init_ray

    init_ray(None, num_cpus=2)
    rows = []
    for rep in range(repeats):
        rows.append(reward_fault_run())
        print(f"repeat {rep} reward worker kill: {rows[-1]}", flush=True)
    result = {
        "repeats": repeats,
        "reward_fault": {k: statistics.median(r[k] for r in rows) for k in rows[0]},
        "reward_fault_runs": rows,
    }
    print(json.dumps(result))
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="stutter")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument(
        "--no-fault",
        action="store_true",
        help="part 1 only (e.g. with train.workers=2: an FSDP2 "
        "group's checkpoints; engine faults do not depend on the trainer)",
    )
    ap.add_argument("--reward-only", action="store_true", help="only part 3: a reward worker killed")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    if args.reward_only:
        return reward_only(args.repeats)
    overrides = [f"train.steps={args.steps}", *args.overrides]
    out = Path(tempfile.mkdtemp(prefix="flash-bench-durability-"))
    runs: dict[str, list[dict]] = {m: [] for m in [*MODES, "fault"]}
    for rep in range(args.repeats):
        for mode in MODES:
            runs[mode].append(checkpoint_run(args.recipe, mode, out / f"{mode}-{rep}", overrides))
            print(f"repeat {rep} checkpoint {mode}: {runs[mode][-1]}", flush=True)
        if not args.no_fault:
            runs["fault"].append(fault_run(args.recipe, out / f"fault-{rep}", args.steps, overrides))
            print(f"repeat {rep} engine kill: {runs['fault'][-1]}", flush=True)
    med = lambda rows, key: statistics.median(r[key] for r in rows)
    result = {"recipe": args.recipe, "repeats": args.repeats, "overrides": overrides, "checkpoint": {}}
    for mode in MODES:
        ratios = [r["step_s"] / o["step_s"] for r, o in zip(runs[mode], runs["off"])]
        result["checkpoint"][mode] = {
            "step_s_median": med(runs[mode], "step_s"),
            "step_s_ratio_vs_off_median": statistics.median(ratios),
            "write_s_median": med(runs[mode], "write_s"),
            "snapshot_s_median": med(runs[mode], "snapshot_s"),
            "bytes": med(runs[mode], "bytes"),
        }
    if runs["fault"]:
        result["engine_fault"] = {k: med(runs["fault"], k) for k in runs["fault"][0]}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
