"""The controller end to end on Ray with a real engine and trainer (small model, few steps).

- ``async_ratio = 0`` reproduces a plain synchronous loop step for step: same samples, same losses.
- Under random per-request delays and every interrupt mode, no trained sample is older than
  ``ceil(r)`` versions and every admitted prompt ends exactly once (trained, buffered or in flight).
"""

import json
import math

import pytest
import ray

from flash.controllers.lifecycle import unbalance
from flash.train.batch import flatten
from flash.app.runner import Run, run
from tests.helpers.inproc import plain_sync_loop, small_cfg


@pytest.fixture(scope="module", autouse=True)
def ray_session(tmp_path_factory):
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def cache(warm_cache):
    return warm_cache


@pytest.mark.parametrize("stream", [False, True])
def test_async_ratio_zero_is_the_plain_synchronous_loop(tmp_path, cache, stream):
    """And so is the stream trainer (each group backpropagated on arrival, one step per batch)."""
    cfg = small_cfg(tmp_path, cache, "async_ratio=0", "algo.loss.name=ppo", f"train.stream={stream}")
    r = Run(cfg, "sync")
    try:
        r.scheduler.start()
        r.scheduler.start_admission()
        records = r.controller.run(3)
    finally:
        r.close()
    ours = [([s.response_ids for s in flatten(rec.groups)], rec.metrics["train/loss"]) for rec in records]
    ref = plain_sync_loop(cfg, r.model_path, r.task, r.tokenizer, 3)
    for t, ((tok_a, loss_a), (tok_b, loss_b)) in enumerate(zip(ours, ref)):
        assert tok_a == tok_b, f"step {t}: different samples"
        # the stream sums the batch in finish order: equal up to float summation order
        assert loss_a == pytest.approx(loss_b, rel=1e-5 if stream else 1e-6, abs=1e-7), f"step {t}"
    assert all(rec.metrics["staleness/max"] == 0 for rec in records)
    assert len({tuple(map(tuple, toks)) for toks, _ in ours}) == 3  # the steps did differ


@pytest.mark.parametrize("ratio, interrupt", [(1, "continue"), (2, "restart"), (1.5, "wait"), (3, "continue")])
def test_staleness_bound_and_nothing_lost_under_random_delays(tmp_path, cache, ratio, interrupt):
    steps = 8
    cfg = small_cfg(
        tmp_path,
        cache,
        f"async_ratio={ratio}",
        f"rollout.interrupt={interrupt}",
        f"train.steps={steps}",
        "rollout.inject_delay_s=0.05",
        "rollout.reward_workers=8",
    )
    summary = run(cfg, "bound")
    assert summary["steps"] == steps
    assert summary["max_staleness_observed"] <= math.ceil(ratio)
    lines = [json.loads(x) for x in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    trained = [x for x in lines if x["outcome"] == "trained"]
    for x in trained:
        assert x["step"] - x["version"] <= math.ceil(ratio)
    per_prompt: dict[int, list] = {}
    for x in trained:
        per_prompt.setdefault(x["prompt_id"], []).append((x["sample"], x["step"]))
    for pid, entries in per_prompt.items():
        assert sorted(k for k, _ in entries) == list(range(cfg.rollout.n)), pid  # each sample once
        assert len({s for _, s in entries}) == 1  # a group trains in one step
    left = [x["prompt_id"] for x in lines if x["outcome"] != "trained" and "request" not in x]
    ended = sorted(list(per_prompt) + left)
    assert ended == list(range(summary["prompts_admitted"]))  # every admitted prompt, exactly once
    assert len(per_prompt) == steps * cfg.train.prompts_per_step
    assert summary["prompts_admitted"] == math.floor((steps + ratio) * cfg.train.prompts_per_step)


def _lifecycle_check(r, trained: list):
    """Per step: the lifecycle balances, its trained count matches the batches, the bound holds."""

    def check(rec):
        m = rec.metrics
        snap = {k[len("rollout/lifecycle/") :]: int(v) for k, v in m.items() if k.startswith("rollout/lifecycle/")}
        trained.append(sum(len(g.samples) for g in rec.groups))
        assert unbalance(snap) == 0, snap
        assert snap["trained"] == sum(trained)
        assert m["rollout/counted_admissions"] <= r.buffer.staleness.admission_limit(rec.step + 1)

    return check


@pytest.mark.slow
@pytest.mark.parametrize("ratio, interrupt, queue", [(1, "continue", "true"), (2, "restart", "false")])
def test_lifecycle_adds_up_with_filters_spares_and_redundancy(tmp_path, cache, ratio, interrupt, queue):
    """Dynamic sampling, over-provisioning and redundant requests on, under random delays: the
    staleness bound holds, every admitted prompt ends exactly once, every request exactly once."""
    steps, extra = 5, 1
    cfg = small_cfg(
        tmp_path,
        cache,
        f"async_ratio={ratio}",
        f"rollout.interrupt={interrupt}",
        f"train.steps={steps}",
        "rollout.inject_delay_s=0.05",
        "rollout.reward_workers=8",
        f"rollout.redundancy={extra}",
        "rollout.filter.all_same_reward=true",
        "rollout.max_additional_prompts=2",
        f"rollout.queue_scheduling={queue}",
    )
    n, B = cfg.rollout.n, cfg.train.prompts_per_step
    r, trained_per_step = Run(cfg, "life"), []
    try:
        r.scheduler.start()
        r.scheduler.start_admission()
        records = r.controller.run(steps, on_step=_lifecycle_check(r, trained_per_step))
        r.controller.shutdown_rollout()
        final, admitted = r.scheduler.lifecycle.snapshot(), r.scheduler.admitted
    finally:
        r.close()
    assert max(rec.metrics["staleness/max"] for rec in records) <= math.ceil(ratio)
    lines = [json.loads(x) for x in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    trained = [x for x in lines if x["outcome"] == "trained"]
    print({o: sum(x["outcome"] == o for x in lines) for o in ("trained", "filtered", "aborted", "in_flight")})
    assert all(x["step"] - x["version"] <= math.ceil(ratio) for x in trained)
    redundant = [x for x in lines if x["outcome"] == "aborted" and "request" in x]
    prompt_level = [x for x in lines if "request" not in x]
    by_prompt: dict[int, set] = {}
    for x in trained:
        by_prompt.setdefault(x["prompt_id"], set()).add((x["sample"], x["request"], x["step"]))
    assert len(by_prompt) == steps * B
    for pid, entries in by_prompt.items():
        assert sorted(s for s, _, _ in entries) == list(range(n)) and len({t for _, _, t in entries}) == 1
        dropped = {x["request"] for x in redundant if x["prompt_id"] == pid}
        assert sorted({q for _, q, _ in entries} | dropped) == list(range(n + extra))  # each request once
        assert not dropped & {q for _, q, _ in entries}  # an aborted request is never trained
    ended = sorted([*by_prompt, *(x["prompt_id"] for x in prompt_level)])
    assert ended == list(range(admitted))  # every admitted prompt, exactly once
    filtered = [x for x in prompt_level if x["outcome"] == "filtered"]
    surplus = [x for x in prompt_level if x["outcome"] == "aborted"]
    assert filtered and redundant, (len(filtered), len(redundant))  # the rules did fire
    assert all(x["rule"] == "all_same_reward" and len(set(x["rewards"])) == 1 for x in filtered)
    assert final["admitted"] == admitted * (n + extra)
    assert final["trained"] == len(trained) == sum(trained_per_step)
    assert final["filtered"] == n * len(filtered)
    assert final["aborted"] == len(redundant) + sum(x["samples"] for x in surplus)
