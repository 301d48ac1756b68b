"""Nothing lost, end to end: `flash run` killed with SIGKILL at random moments and resumed.

Each run is a real subprocess (its own Ray, engine and trainer actors) in its own session; a kill
takes the whole session (driver, Ray's daemons and workers) with SIGKILL, as a preempted node
would. Kills land after a random delay, and once inside a checkpoint write (``FLASH_CKPT_PAUSE_S``
holds the write open between the trainer's file and the manifest). Before the last resume the
newest checkpoint is truncated on disk: the resume must detect it and fall back to the previous one.

What must hold at the end (DESIGN.md invariant 5): the ledger shows every prompt of the planned
steps trained exactly once (each of its samples once), none twice, none missing, step numbers in
metrics.jsonl continue 1..N once each; with ``async_ratio=0`` and ``rollout.interrupt=wait`` the
losses equal an uninterrupted run's exactly. With ``async_ratio=2`` every admitted prompt ends
exactly once: trained, or buffered / in flight at the end.
"""

import collections
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS, B, N = 6, 4, 4
SMALL = ["sft.steps=40", "sft.eval_after=false", "model.tiny.num_layers=2", f"train.prompts_per_step={B}",
         f"rollout.n={N}", "rollout.max_new_tokens=24", "task.eval_size=8", "tracking.tensorboard=false",
         "tracking.progress=false", "resources.engine_threads=1", "resources.trainer_threads=1",
         "ray.num_cpus=2", f"train.steps={STEPS}", "checkpoint.every_steps=1", "checkpoint.keep_last=2"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    # FLASH_TEST_CACHE: reuse a warm-start cache across local runs (CI starts empty)
    return os.environ.get("FLASH_TEST_CACHE") or str(tmp_path_factory.mktemp("cache"))


def launch(run_dir: Path, cache: str, extra: list[str], env_extra: dict | None = None,
           recipe: str = "recipes/stutter.yaml", base: list[str] = SMALL) -> subprocess.Popen:
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


def finish(proc: subprocess.Popen, run_dir: Path) -> None:
    rc = proc.wait(timeout=900)
    assert rc == 0, (run_dir.parent / f"{run_dir.name}.log").read_text()[-3000:]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def roles_ready(run_dir: Path) -> int:
    path = run_dir / "events.jsonl"
    return sum(e["event"] == "roles_ready" for e in read_jsonl(path)) if path.exists() else 0


def kill_and_resume(run_dir: Path, cache: str, extra: list[str], rng: random.Random,
                    damage: str = "trainer.pt") -> list[dict]:
    """Run and kill at a random moment (after 2-4 steps and two complete checkpoints, then up to
    1.5 s more; each checkpoint write held 1 s so steps last long enough to land anywhere in one),
    resume and kill inside a checkpoint write, truncate the newest checkpoint, resume to the end.
    ``damage``: the file of the newest checkpoint truncated. Returns the resume events."""
    proc = launch(run_dir, cache, [f"run_dir={run_dir}", *extra], {"FLASH_CKPT_PAUSE_S": "1"})
    k = rng.randint(2, 4)
    assert wait_for(lambda: steps_done(run_dir) >= k and len(checkpoints(run_dir)) >= 2, proc)
    time.sleep(rng.uniform(0.0, 1.5))
    kill_run(proc)
    assert steps_done(run_dir) < STEPS
    proc = launch(run_dir, cache, [f"resume={run_dir}", *extra], {"FLASH_CKPT_PAUSE_S": "4"})
    # stale .tmp dirs of the killed run are removed at resume, before roles_ready
    assert wait_for(lambda: roles_ready(run_dir) == 2 and checkpoints(run_dir, tmp=True), proc)
    kill_run(proc)  # inside a checkpoint write: its .tmp dir is there, its manifest is not
    complete = checkpoints(run_dir)
    assert len(complete) >= 2, complete
    newest = max(complete, key=lambda p: int(p.name.split("-")[1]))
    with open(newest / damage, "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    finish(launch(run_dir, cache, [f"resume={run_dir}", *extra]), run_dir)
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "resume"]


def trained_pairs(ledger: list[dict]) -> collections.Counter:
    return collections.Counter((e["prompt_id"], e["sample"]) for e in ledger if e["outcome"] == "trained")


@pytest.mark.slow
def test_sync_run_killed_and_resumed_trains_every_prompt_once_with_the_same_losses(tmp_path, cache):
    extra = ["async_ratio=0", "rollout.interrupt=wait"]
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    reference = launch(ref_dir, cache, [f"run_dir={ref_dir}", *extra])
    finish(reference, ref_dir)  # also builds the warm-start cache the killed runs share
    resumes = kill_and_resume(run_dir, cache, extra, random.Random(0))

    assert len(resumes) == 2
    assert any("trainer.pt has" in s for e in resumes for s in e["skipped"]), resumes  # the truncated one
    ledger = read_jsonl(run_dir / "ledger.jsonl")
    pairs = trained_pairs(ledger)
    assert set(pairs.values()) == {1}  # none twice
    assert set(pairs) == {(p, k) for p in range(STEPS * B) for k in range(N)}  # none missing, none extra
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    want = [m["train/loss"] for m in read_jsonl(ref_dir / "metrics.jsonl")]
    assert [m["train/loss"] for m in metrics] == want
    assert trained_pairs(read_jsonl(ref_dir / "ledger.jsonl")) == pairs


@pytest.mark.slow
def test_async_run_killed_and_resumed_loses_and_repeats_no_prompt(tmp_path, cache):
    run_dir = tmp_path / "async"
    extra = ["async_ratio=2", "rollout.interrupt=continue", "rollout.inject_delay_s=0.05"]
    kill_and_resume(run_dir, cache, extra, random.Random(1))

    ledger = read_jsonl(run_dir / "ledger.jsonl")
    pairs = trained_pairs(ledger)
    assert set(pairs.values()) == {1} and len(pairs) == STEPS * B * N
    trained = {p for p, _ in pairs}
    assert all(pairs[(p, k)] for p in trained for k in range(N))  # whole groups
    left = [e["prompt_id"] for e in ledger if e["outcome"] in ("buffered", "in_flight")]
    assert len(left) == len(set(left)) and not set(left) & trained
    summary = json.loads((run_dir / "summary.json").read_text())
    assert sorted(trained | set(left)) == list(range(summary["prompts_admitted"]))  # every admitted prompt ends once
    data_index = {e["prompt_id"]: e["data_index"] for e in ledger if e["outcome"] == "trained"}
    assert all(data_index[p] == p for p in trained)  # no data row skipped or read twice
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, STEPS + 1))
