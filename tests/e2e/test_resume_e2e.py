"""Nothing lost, end to end: `flash run` killed with SIGKILL at random moments and resumed.

Each run is a real subprocess (its own Ray, engine and trainer actors) in its own session; a kill
takes the whole session (driver, Ray's daemons and workers) with SIGKILL, as a preempted node
would. Kills land after a random delay, and once inside a checkpoint write (``FLASH_CKPT_PAUSE_S``
holds the write open between the trainer's file and the manifest). Before the last resume the
newest checkpoint is truncated on disk: the resume must detect it and fall back to the previous one.

What must hold at the end (docs/design.md invariant 5): the ledger shows every prompt of the planned
steps trained exactly once (each of its samples once), none twice, none missing, step numbers in
metrics.jsonl continue 1..N once each; with ``async_ratio=0`` and ``rollout.interrupt=wait`` the
losses equal an uninterrupted run's exactly. That run reads its prompts from a dataset file (the
stutter task exported, one epoch of shuffled rows ending the run): every row of the epoch is
trained exactly once across the kills. With ``async_ratio=2`` every admitted prompt ends
exactly once: trained, or buffered / in flight at the end.
"""

import json
import random

import pytest
from tests.helpers.processes import (
    B,
    N,
    STEPS,
    finish,
    kill_and_resume,
    launch,
    read_jsonl,
    recipe_warm_start_base,
    replay_run,
    trained_pairs,
)

from flash.app.config import load_config
from flash.app.data import build_task
from flash.app.data_preview import export_task


@pytest.fixture(scope="module")
def cache(warm_cache):
    return warm_cache


def stutter_rows(tmp_path) -> list[str]:
    """The stutter task as files: one epoch of ``STEPS * B`` train rows, 8 held-out rows; a run over
    them ends after one epoch (``data.epochs=1``, ``train.steps`` set far beyond it)."""
    options = {k: v for k, v in load_config("recipes/stutter.yaml").task.items() if k != "name"}
    export_task("stutter", options, str(tmp_path / "train.jsonl"), rows=STEPS * B)
    export_task("stutter", options, str(tmp_path / "eval.jsonl"), rows=8, split="eval")
    return [
        f"data.train=[{tmp_path}/train.jsonl]",
        f"data.eval=[{tmp_path}/eval.jsonl]",
        "data.sft_key=solution",
        "data.reward=tests.reward_fns:exact",
        "data.epochs=1",
        "train.steps=100",
    ]


@pytest.mark.slow
def test_sync_run_killed_and_resumed_trains_every_prompt_once_with_the_same_losses(tmp_path, cache):
    extra = ["async_ratio=0", "rollout.interrupt=wait", *stutter_rows(tmp_path)]
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    sets = [f"eval.sets={{rows: {tmp_path}/eval.jsonl, words: {{task: stutter, eval_size: 6}}}}", "eval.n=2"]
    reference = launch(ref_dir, cache, [f"run_dir={ref_dir}", *extra, *sets])
    finish(reference, ref_dir)  # also builds the warm-start cache the killed runs share
    evals = read_jsonl(ref_dir / "eval.jsonl")  # the named sets: before and after training
    assert [e["step"] for e in evals] == [0, STEPS]
    for name, items in (("rows", 8), ("words", 6)):
        for e in evals:
            assert {
                f"eval/{name}/{m}" for m in ("mean@2", "pass@1", "pass@2", "reward_mean", "response_tokens")
            } <= set(e["sets"])
            assert e["sets"][f"eval/{name}/pass@1"] <= e["sets"][f"eval/{name}/pass@2"]
            lines = read_jsonl(ref_dir / "eval" / name / f"step-{e['step']}.jsonl")
            assert [(x["item"], x["sample"]) for x in lines] == [(i, k) for i in range(items) for k in range(2)]
            assert sum(x["reward"] >= 1 for x in lines) / len(lines) == pytest.approx(e["sets"][f"eval/{name}/mean@2"])
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
    task = build_task(load_config("recipes/stutter.yaml", extra))
    rows = [task.position(e["data_index"]) for e in ledger if e["outcome"] == "trained" and e["sample"] == 0]
    assert sorted(rows) == [(0, r) for r in range(STEPS * B)]  # epoch 0, each row once
    assert {r for _, r in rows[:B]} != set(range(B))  # in the epoch's shuffled order


@pytest.mark.slow
def test_async_run_killed_and_resumed_loses_and_repeats_no_prompt(tmp_path, cache):
    run_dir = tmp_path / "async"
    # the default recipe's warm start (its learning test builds it in the session): rewards differ
    # within groups, so steps have gradients for the replay to find
    extra = ["async_ratio=2", "rollout.interrupt=continue", "rollout.inject_delay_s=0.05"]
    kill_and_resume(run_dir, cache, extra, random.Random(1), base=recipe_warm_start_base())

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
    # the schedule record was cut back with the other logs at each resume: one line per step, and
    # re-training from it finds every step's loss of the three processes again
    schedule = read_jsonl(run_dir / "schedule.jsonl")
    assert [line["step"] for line in schedule] == list(range(STEPS))
    assert [line["train"]["loss"] for line in schedule] == [
        m["train/loss"] for m in read_jsonl(run_dir / "metrics.jsonl")
    ]
    stale = [
        line["step"] - min(s["versions"])
        for line in schedule
        for g in line["groups"]
        for s in g["samples"]
        if s["versions"]
    ]
    assert max(stale) >= 1  # it trained on older samples: the schedule was truly asynchronous
    losses = [line["train"]["loss"] for line in schedule]
    assert sum(loss != 0 for loss in losses) >= 2, losses  # steps with a gradient to reproduce
    rc, out = replay_run(run_dir, "--out", str(tmp_path / "replay.jsonl"))
    assert rc == 0 and f"{STEPS} steps" in out and "every step's loss and gradient norm identical" in out, out
    lines = read_jsonl(tmp_path / "replay.jsonl")
    assert [x["loss_replayed"] for x in lines] == losses
    assert [x["grad_norm_replayed"] for x in lines] == [line["train"]["grad_norm"] for line in schedule]
    # a record that does not explain the run is caught at its step: flip every reward of the first
    # step that had a gradient, and its advantages change sign
    k = next(i for i, loss in enumerate(losses) if loss != 0)
    for g in schedule[k]["groups"]:
        for s in g["samples"]:
            s["reward"] = 1.0 - s["reward"]
    (run_dir / "schedule.jsonl").write_text("".join(json.dumps(line) + "\n" for line in schedule))
    rc, out = replay_run(run_dir, "--steps", str(k + 1))
    assert rc == 1 and f"step {k} differs first" in out and f"{k} steps identical" in out, out
