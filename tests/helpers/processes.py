"""``flash run`` as a subprocess: launch it, kill it (its whole session), resume it, read its logs."""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: tests/helpers/ is two below


STEPS, B, N = 6, 4, 4


SMALL = [
    "sft.steps=40",
    "sft.eval_after=false",
    "model.tiny.num_layers=2",
    f"train.prompts_per_step={B}",
    f"rollout.n={N}",
    "rollout.max_new_tokens=24",
    "task.eval_size=8",
    "tracking.tensorboard=false",
    "tracking.progress=false",
    "resources.engine_threads=1",
    "resources.trainer_threads=1",
    "ray.num_cpus=2",
    f"train.steps={STEPS}",
    "checkpoint.every_steps=1",
    "checkpoint.keep_last=2",
]


def launch(
    run_dir: Path,
    cache: str,
    extra: list[str],
    env_extra: dict | None = None,
    recipe: str = "recipes/stutter.yaml",
    base: list[str] = SMALL,
) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0", **(env_extra or {})}
    cmd = [sys.executable, "-m", "flash.app.cli", "run", recipe, *base, f"cache_dir={cache}", *extra]
    with open(run_dir.parent / f"{run_dir.name}.log", "a") as log:  # the child keeps its own copy
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def session_pids(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:  # field 6 of stat: the session id
                pids.append(int(entry))
    return pids


def kill_run(proc: subprocess.Popen) -> None:
    """SIGKILL every process of the run's session (the driver and everything Ray started for it)."""
    for _ in range(20):
        pids = session_pids(proc.pid)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    proc.wait(timeout=30)


def wait_for(pred, proc, timeout=600.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.1)
    raise TimeoutError("condition not reached")


def checkpoints(run_dir: Path, tmp=False) -> list[Path]:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.endswith(".tmp") == tmp)


def finish(proc: subprocess.Popen, run_dir: Path, timeout: float = 900) -> None:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_run(proc)  # its whole session (driver, Ray), so a timed-out run leaves nothing behind
        raise
    assert rc == 0, (run_dir.parent / f"{run_dir.name}.log").read_text()[-3000:]


def recipe_summary(run_dir: Path, cache: str, recipe: str, overrides: list[str], timeout: float = 900) -> dict:
    """A whole recipe run by the CLI in a process of its own (nothing of the test session's state:
    threads, RNG, Ray, imported plugins), as a user runs it; its summary.json."""
    finish(
        launch(run_dir, cache, [f"run_dir={run_dir}", "tracking.progress=false", *overrides], recipe=recipe, base=[]),
        run_dir,
        timeout,
    )
    return json.loads((run_dir / "summary.json").read_text())


def replay_run(run_dir: Path, *args: str) -> tuple[int, str]:
    """``flash replay RUN_DIR ARGS`` in a process of its own: (exit code, its output)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "flash.app.cli", "replay", str(run_dir), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def roles_ready(run_dir: Path) -> int:
    path = run_dir / "events.jsonl"
    return sum(e["event"] == "roles_ready" for e in read_jsonl(path)) if path.exists() else 0


def recipe_warm_start_base(recipe: str = "recipes/stutter.yaml") -> list[str]:
    """``SMALL`` with the recipe's own model, SFT stage and held-out set in place of its small ones:
    a run on this base loads the warm start the recipe itself builds (the same cache key), so a test
    that needs a policy some of whose answers are right shares the one the recipe's learning test
    builds in the session instead of training one of its own."""
    own = ("model.tiny.", "sft.", "task.eval_size=")
    return [o for o in SMALL if not o.startswith(own)] + ["eval.n=1"]


def kill_and_resume(
    run_dir: Path, cache: str, extra: list[str], rng: random.Random, damage: str = "trainer.pt", base: list[str] = SMALL
) -> list[dict]:
    """Run and kill at a random moment (after 2-4 steps and two complete checkpoints, then up to
    1.5 s more; each checkpoint write held 1 s so steps last long enough to land anywhere in one),
    resume and kill inside a checkpoint write, truncate the newest checkpoint, resume to the end.
    ``damage``: the file of the newest checkpoint truncated. Returns the resume events."""
    proc = launch(run_dir, cache, [f"run_dir={run_dir}", *extra], {"FLASH_CKPT_PAUSE_S": "1"}, base=base)
    k = rng.randint(2, 4)
    assert wait_for(lambda: steps_done(run_dir) >= k and len(checkpoints(run_dir)) >= 2, proc)
    time.sleep(rng.uniform(0.0, 1.5))
    kill_run(proc)
    assert steps_done(run_dir) < STEPS
    proc = launch(run_dir, cache, [f"resume={run_dir}", *extra], {"FLASH_CKPT_PAUSE_S": "4"}, base=base)
    # stale .tmp dirs of the killed run are removed at resume, before roles_ready
    assert wait_for(lambda: roles_ready(run_dir) == 2 and checkpoints(run_dir, tmp=True), proc)
    kill_run(proc)  # inside a checkpoint write: its .tmp dir is there, its manifest is not
    complete = checkpoints(run_dir)
    assert len(complete) >= 2, complete
    newest = max(complete, key=lambda p: int(p.name.split("-")[1]))
    with open(newest / damage, "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    finish(launch(run_dir, cache, [f"resume={run_dir}", *extra], base=base), run_dir)
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "resume"]


def trained_pairs(ledger: list[dict]) -> collections.Counter:
    return collections.Counter((e["prompt_id"], e["sample"]) for e in ledger if e["outcome"] == "trained")


TINY_OVERRIDES = ["model.tiny.num_layers=1", "model.tiny.intermediate_size=64", "sft.steps=80", "sft.eval_after=false"]
