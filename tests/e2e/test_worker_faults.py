"""A reward or environment worker killed mid-run costs seconds, not the run, and loses nothing.

Real `flash run` subprocesses. Each kills one worker process (its pid from ``events.jsonl``) with
SIGKILL while it is busy, after the first train step:

- a reward worker inside a call of ``tests.reward_fns:marked_exact`` (a marker file names the
  process while a call runs): the pool replaces it and issues that call again, so the response is
  scored for real, never 0 for the crash (no ``reward/failures/*``, no reward errors);
- an environment worker of the corridor game while episodes live in it: Ray restarts it and each
  of its episodes plays again from its reset, filed once;
- the rollout engine of the same corridor run while episodes wait on their LLM turns: Ray restarts
  it, it gets the last pushed weights, and every waiting turn is asked again (same context, same
  seed); the environments are not touched.

Both runs must finish, count the fault exactly once (metrics, summary, one event), and their ledger
must show every admitted prompt ending exactly once: each trained sample once, the rest buffered
or in flight at the end.
"""

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.processes import (
    ROOT,
    STEPS,
    B,
    N,
    finish,
    launch,
    read_jsonl,
    wait_for,
)


def events(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [e for e in read_jsonl(path) if e["event"] == kind] if path.exists() else []


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def check_ledger(run_dir: Path, steps: int, prompts: int, n: int) -> dict:
    """Every admitted prompt ends once: trained (each sample once) or left buffered / in flight."""
    summary = json.loads((run_dir / "summary.json").read_text())
    ledger = read_jsonl(run_dir / "ledger.jsonl")
    pairs = collections.Counter((e["prompt_id"], e["sample"]) for e in ledger if e["outcome"] == "trained")
    assert set(pairs.values()) == {1} and len(pairs) == steps * prompts * n
    trained = {p for p, _ in pairs}
    left = [e["prompt_id"] for e in ledger if e["outcome"] in ("buffered", "in_flight")]
    assert len(left) == len(set(left)) and not set(left) & trained
    assert sorted(trained | set(left)) == list(range(summary["prompts_admitted"]))
    return summary


@pytest.fixture(scope="module")
def cache(warm_cache):
    return warm_cache


def newest_marker(mark_dir: Path) -> int | None:
    """The pid of the reward worker that started a call last (the most time left in it)."""
    names = [p.name for p in mark_dir.iterdir()]
    return int(max(names, key=lambda s: int(s.split("-")[1])).split("-")[0]) if names else None


@pytest.mark.slow
def test_reward_worker_killed_mid_call_is_replaced_and_the_call_scored_again(tmp_path, cache):
    run_dir, marks = tmp_path / "reward", tmp_path / "marks"
    marks.mkdir()
    proc = launch(
        run_dir,
        cache,
        [
            f"run_dir={run_dir}",
            "async_ratio=2",
            "checkpoint.every_steps=0",
            "reward.fn.name=tests.reward_fns:marked_exact",
            f"reward.fn.mark_dir={marks}",
            "reward.fn.seconds=0.3",
            "reward.num_workers=2",
        ],
    )
    assert wait_for(lambda: steps_done(run_dir) >= 1 and newest_marker(marks), proc)
    pids = events(run_dir, "workers_ready")[0]["reward_pids"]
    pid = newest_marker(marks)
    assert pid in pids
    os.kill(pid, signal.SIGKILL)
    finish(proc, run_dir)

    faults = events(run_dir, "reward_fault")
    assert len(faults) == 1 and faults[0]["kind"] == "died"
    summary = check_ledger(run_dir, STEPS, B, N)
    assert summary["faults_reward"] == 1 and summary["reward_errors"] == 0
    last = read_jsonl(run_dir / "metrics.jsonl")[-1]
    assert last["faults/reward"] == 1.0 and last["reward/worker_restarts"] == 1.0
    assert last["reward/reissued"] >= 1.0  # the call it was running was issued again ...
    assert not [k for k in last if k.startswith("reward/failures/")]  # ... and none scored 0 for the crash


CORRIDOR_STEPS, CORRIDOR_B, CORRIDOR_N = 4, 2, 2
CORRIDOR = [
    "model.tiny.num_layers=1",
    "model.tiny.intermediate_size=64",
    "sft.steps=80",
    "sft.eval_after=false",
    f"train.steps={CORRIDOR_STEPS}",
    f"train.prompts_per_step={CORRIDOR_B}",
    f"rollout.n={CORRIDOR_N}",
    "async_ratio=1",
    "task.eval_size=4",
    "task.step_delay_s=0.2",
    "tracking.tensorboard=false",
    "tracking.progress=false",
    "resources.engine_threads=1",
    "resources.trainer_threads=1",
    "ray.num_cpus=2",
    "checkpoint.every_steps=0",
]


def launch_corridor(run_dir: Path, cache: str) -> tuple[subprocess.Popen, Path]:
    """The small corridor run as a `flash run` subprocess (its log beside ``run_dir``)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
    cmd = [
        sys.executable,
        "-m",
        "flash.app.cli",
        "run",
        "recipes/corridor.yaml",
        *CORRIDOR,
        f"cache_dir={cache}",
        f"run_dir={run_dir}",
    ]
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, run_dir


@pytest.mark.slow
def test_env_worker_killed_mid_episode_is_restarted_and_its_episodes_replayed(tmp_path, cache):
    proc, run_dir = launch_corridor(tmp_path / "env", cache)
    assert wait_for(lambda: steps_done(run_dir) >= 1, proc)
    pid = events(run_dir, "workers_ready")[0]["env_pids"][0]
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    finish(proc, run_dir)

    faults = events(run_dir, "env_fault")
    assert len(faults) == 1 and faults[0]["worker"] == 0 and faults[0]["pid"] != pid
    assert faults[0]["time"] >= killed - 1.0
    summary = check_ledger(run_dir, CORRIDOR_STEPS, CORRIDOR_B, CORRIDOR_N)
    assert summary["faults_env"] == 1
    counters = summary["rollout_counters"]
    assert counters["episodes_restarted"] >= 1 and not counters.get("env_errors")
    assert read_jsonl(run_dir / "metrics.jsonl")[-1]["faults/env"] == 1.0


@pytest.mark.slow
def test_engine_killed_mid_episodes_is_restarted_and_their_turns_asked_again(tmp_path, cache):
    proc, run_dir = launch_corridor(tmp_path / "env_engine", cache)
    assert wait_for(lambda: steps_done(run_dir) >= 1, proc)
    pid = events(run_dir, "roles_ready")[0]["engine_pid"]
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    finish(proc, run_dir)

    faults = events(run_dir, "engine_fault")
    assert len(faults) == 1 and faults[0]["kind"] == "died" and faults[0]["pid"] != pid
    assert faults[0]["time"] >= killed - 1.0
    summary = check_ledger(run_dir, CORRIDOR_STEPS, CORRIDOR_B, CORRIDOR_N)
    assert summary["faults_engine"] == 1 and summary["faults_env"] == 0
    assert not summary["rollout_counters"].get("request_errors")  # no turn was lost or refused
    assert read_jsonl(run_dir / "metrics.jsonl")[-1]["faults/engine"] == 1.0
