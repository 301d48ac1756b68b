"""Nothing lost in the other setups: `flash run` with the zmq buffer service, with an FSDP2 trainer
group, and with environment episodes, each killed with SIGKILL after a checkpoint and resumed
(the helpers and the kill scheme of test_resume_e2e.py).

- zmq: killed once a checkpoint holds groups in the service's store; those groups come back and are
  trained as they were saved (same rewards and versions: not generated again), none twice.
- FSDP2 group (``train.workers=2``, margin): the full scheme (random kill, kill inside a checkpoint write,
  the newest checkpoint's DCP shard truncated); at ``async_ratio=0`` with ``rollout.interrupt=wait``
  the losses equal an uninterrupted group run's exactly.
- Episodes (corridor): killed once a checkpoint holds seeds in flight; every planned episode is
  trained exactly once, every admitted seed ends once.
"""

import json
import random
from pathlib import Path

import pytest

from flash.checkpoint import complete_checkpoints, latest_valid
from tests.helpers.processes import TINY_OVERRIDES
from tests.helpers.processes import (
    STEPS,
    B,
    N,
    finish,
    kill_and_resume,
    kill_run,
    launch,
    read_jsonl,
    steps_done,
    trained_pairs,
    wait_for,
)


@pytest.fixture(scope="module")
def cache(warm_cache):
    return warm_cache


def newest_state(run_dir: Path) -> dict:
    """state.json of the newest complete checkpoint ({} when none yet)."""
    found = complete_checkpoints(run_dir / "checkpoints")
    try:
        return json.loads((found[0] / "state.json").read_text()) if found else {}
    except (OSError, ValueError):  # pruned meanwhile
        return {}


def kill_when(run_dir: Path, proc, cond, steps: int) -> dict:
    """SIGKILL the run once ``cond(newest checkpoint's state)`` holds; the state the resume will use."""
    assert wait_for(lambda: steps_done(run_dir) >= 2 and cond(newest_state(run_dir)), proc)
    kill_run(proc)
    assert steps_done(run_dir) < steps  # killed mid-way, not after the end
    ckpt, _ = latest_valid(run_dir / "checkpoints")
    return json.loads((ckpt / "state.json").read_text())


def ends_once(run_dir: Path, ledger: list[dict], steps: int, prompts: int, n: int) -> set[int]:
    """Every planned sample trained once (whole groups), every admitted prompt ends exactly once
    (trained, or buffered / in flight at the end), no data row skipped; returns the trained prompts."""
    pairs = trained_pairs(ledger)
    assert set(pairs.values()) == {1} and len(pairs) == steps * prompts * n
    trained = {p for p, _ in pairs}
    assert all(pairs[(p, k)] for p in trained for k in range(n))
    left = [e["prompt_id"] for e in ledger if e["outcome"] in ("buffered", "in_flight")]
    assert len(left) == len(set(left)) and not set(left) & trained
    summary = json.loads((run_dir / "summary.json").read_text())
    assert sorted(trained | set(left)) == list(range(summary["prompts_admitted"]))
    assert all(e["data_index"] == e["prompt_id"] for e in ledger if e["outcome"] == "trained")
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, steps + 1))
    return trained


@pytest.mark.slow
def test_zmq_buffer_run_killed_and_resumed_trains_the_saved_groups_as_saved(tmp_path, cache):
    run_dir = tmp_path / "zmq"
    extra = ["buffer.transport=zmq", "async_ratio=2", "rollout.interrupt=continue", "rollout.inject_delay_s=0.05"]
    saved = kill_when(
        run_dir, launch(run_dir, cache, [f"run_dir={run_dir}", *extra]), lambda state: bool(state.get("buffer")), STEPS
    )
    assert saved["buffer"], "the checkpoint the resume uses holds none of the service's groups"
    finish(launch(run_dir, cache, [f"resume={run_dir}", *extra]), run_dir)

    ledger = read_jsonl(run_dir / "ledger.jsonl")
    trained = ends_once(run_dir, ledger, STEPS, B, N)
    got = {(e["prompt_id"], e["sample"]): (e["reward"], e["version"]) for e in ledger if e["outcome"] == "trained"}
    saved_trained = [g for g in saved["buffer"] if g["prompt_id"] in trained]
    assert saved_trained  # the oldest groups are taken first: some of the saved ones were trained
    for g in saved_trained:
        for s in g["samples"]:
            assert got[(g["prompt_id"], s["sample_index"])] == (s["reward"], min(s["versions"]))


@pytest.mark.slow
@pytest.mark.margin  # 2+ minutes; the group's checkpoint (DCP shards in the manifest, resharding) is pinned by
# test_checkpoint_setups.py and the kill/resume scheme by test_resume_e2e.py in the default run
def test_fsdp2_group_run_killed_and_resumed_trains_every_prompt_once_with_the_same_losses(tmp_path, cache):
    extra = ["async_ratio=0", "rollout.interrupt=wait", "train.workers=2"]
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    finish(launch(ref_dir, cache, [f"run_dir={ref_dir}", *extra]), ref_dir)
    resumes = kill_and_resume(run_dir, cache, extra, random.Random(2), damage="trainer/__0_0.distcp")

    assert len(resumes) == 2
    assert any("trainer/__0_0.distcp has" in s for e in resumes for s in e["skipped"]), resumes
    ledger = read_jsonl(run_dir / "ledger.jsonl")
    pairs = trained_pairs(ledger)
    assert set(pairs.values()) == {1}
    assert set(pairs) == {(p, k) for p in range(STEPS * B) for k in range(N)}
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert [m["train/loss"] for m in metrics] == [m["train/loss"] for m in read_jsonl(ref_dir / "metrics.jsonl")]
    assert trained_pairs(read_jsonl(ref_dir / "ledger.jsonl")) == pairs


EPISODE_STEPS, EPISODE_B, EPISODE_N = 4, 2, 2
CORRIDOR = [
    *TINY_OVERRIDES,
    f"train.steps={EPISODE_STEPS}",
    f"train.prompts_per_step={EPISODE_B}",
    f"rollout.n={EPISODE_N}",
    "async_ratio=1",
    "task.eval_size=4",
    "task.step_delay_s=0.05",
    "tracking.tensorboard=false",
    "tracking.progress=false",
    "resources.engine_threads=1",
    "resources.trainer_threads=1",
    "ray.num_cpus=2",
    "checkpoint.every_steps=1",
    "checkpoint.keep_last=2",
]


@pytest.mark.slow
def test_episode_run_killed_and_resumed_trains_every_episode_once(tmp_path, cache):
    run_dir = tmp_path / "corridor"
    corridor = {"recipe": "recipes/corridor.yaml", "base": CORRIDOR}
    saved = kill_when(
        run_dir,
        launch(run_dir, cache, [f"run_dir={run_dir}"], **corridor),
        lambda state: bool(state.get("scheduler", {}).get("pending")),
        EPISODE_STEPS,
    )
    in_flight = {p["prompt_id"] for p in saved["scheduler"]["pending"]}
    assert in_flight, "the checkpoint the resume uses holds no seed in flight"
    finish(launch(run_dir, cache, [f"resume={run_dir}"], **corridor), run_dir)

    ledger = read_jsonl(run_dir / "ledger.jsonl")
    trained = ends_once(run_dir, ledger, EPISODE_STEPS, EPISODE_B, EPISODE_N)
    assert in_flight & trained  # seeds in flight at the kill were played again and trained
    resumes = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] == saved["step"]
