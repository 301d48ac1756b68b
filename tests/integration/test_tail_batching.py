"""Tail batching (controllers/tail_batching.py, controllers/tail_policy.py).

The scheduler against a scripted engine whose responses have scripted lengths and take time in
proportion to the tokens generated, and which honours ``max_new_tokens`` (a capped request ends
early with ``finish_reason='length'``), so which groups are cut, swapped or re-run is exact. A
driver loop plays the controller (batch selection under the staleness rule, version bumps). The
real controller with a real engine: the threshold at infinity equals the plain synchronous loop
(below). The rules on their own: test_tail_rules.py.
"""

import math
import random
import time
from dataclasses import dataclass

import pytest
import ray

from flash.buffers import SampleBuffer
from flash.controllers.lifecycle import unbalance
from flash.controllers.scheduler import PromptSource
from flash.controllers.staleness import StalenessManager
from flash.controllers.tail_batching import TailBatchingScheduler
from flash.controllers.tail_policy import TailConfig
from flash.engine.base import GenerationOutput, SamplingParams
from tests.scripted_engine import ScriptedEngine

MAX_NEW = 16


# ---- the scheduler against a scripted engine ------------------------------------------------------
class LengthEngine(ScriptedEngine):
    """Responses of ``length(data index, request index)`` tokens at ``per_token`` s each, cut at the
    request's ``max_new_tokens`` (then ``finish_reason='length'``, sooner). Tokens carry the version
    the engine had when the request was submitted."""

    def __init__(self, length, per_token=0.01):
        super().__init__({})
        self.length, self.per_token, self._version = length, per_token, 0
        self.caps: dict[str, int] = {}
        self.submit_version: dict[str, int] = {}

    def set_version(self, v):
        self._version = v

    def submit(self, requests):
        now = time.time()
        with self._cv:
            for r in requests:
                n = min(self._len(r), r.params.max_new_tokens)
                self._due[r.request_id] = (now + n * self.per_token, r)
                self.caps[r.request_id] = r.params.max_new_tokens
                self.submitted.append(r)
                self.submit_version[r.request_id] = self._version
            self._cv.notify_all()
        return len(requests)

    def _len(self, r):
        return self.length(r.prompt_ids[-1], int(r.request_id.split(":")[1]))

    def _output(self, r, reason):
        full, cap = self._len(r), r.params.max_new_tokens
        n = min(full, cap) if reason != "abort" else 1
        reason = reason if reason == "abort" or full <= cap else "length"
        return GenerationOutput(
            r.request_id, list(r.prompt_ids), [1] * n, [-0.5] * n, [self.submit_version[r.request_id]] * n, reason
        )

    def request_caps(self):
        with self._cv:
            return dict(self.caps)


@dataclass
class Item:
    index: int

    @property
    def prompt(self):
        return str(self.index)


def make(length, *, B=2, r=0.0, n=2, per_token=0.01, **tail):
    engine = ray.remote(LengthEngine).options(num_cpus=0, max_concurrency=8).remote(length, per_token)
    source = PromptSource(
        item=Item,
        encode=lambda s: [5, int(s)],
        decode=lambda ids: str(len(ids)),
        reward=lambda item, text: float(item.index % 2),
    )
    buffer = SampleBuffer(capacity=64)
    sched = TailBatchingScheduler(
        engine,
        source,
        buffer,
        StalenessManager(r, B),
        SamplingParams(max_new_tokens=MAX_NEW),
        n=n,
        seed=3,
        reward_workers=4,
        tail=TailConfig(**tail),
    )
    return sched, buffer, engine


def take(buffer, count, timeout=120.0):
    return buffer.get_batch(count, select=lambda gs: list(range(count)) if len(gs) >= count else None, timeout=timeout)


@pytest.mark.usefixtures("ray_local")
def test_a_group_past_the_threshold_is_cut_whole_and_reruns_whole_in_a_long_round():
    # data 1, request 1 runs to 12 tokens: past the threshold 4, so prompt 1's group is cut (its
    # request 0, of 3 tokens, is dropped with it) and prompt 2 (data 2) refills the slot.
    lengths = {(1, 1): 12}
    sched, buffer, engine = make(
        lambda d, k: lengths.get((d, k), 3), threshold="4", over_provision=1.0, long_round_queue=1
    )
    sched.start()
    sched.start_admission()
    groups = take(buffer, 2)
    assert sorted(g.data_index for g in groups) == [0, 2]
    assert all(len(s.response_ids) <= 4 and s.meta["round"] == "short" for g in groups for s in g.samples)
    sched.quiesce()
    events = sched.drain_outcomes()
    assert [(e["prompt_id"], e["data_index"], e["reason"], e["why"], e["samples"]) for e in events] == [
        (1, 1, "tail_cut", "threshold", 2)
    ]
    m = sched.metrics()
    assert m["rollout/aborted/tail_cut"] == 2 and m["rollout/tail/long_queue"] == 1
    assert m["rollout/tail/threshold"] == 4 and m["rollout/counted_admissions"] == 2
    caps = ray.get(engine.request_caps.remote())
    assert {rid: c for rid, c in caps.items()} == {f"{p}:{k}": 4 for p in range(3) for k in range(2)}
    sched.mark_trained(groups)
    sched.set_version(1)  # the queue holds 1 = long_round_queue: a long round
    groups = take(buffer, 2)
    rerun = [g for g in groups if g.data_index == 1]
    assert len(rerun) == 1 and [len(s.response_ids) for s in rerun[0].samples] == [3, 12]  # whole, full length
    assert all(s.meta["round"] == "long" for g in groups for s in g.samples)
    assert rerun[0].samples[0].meta["cut_from"] == 1
    caps = ray.get(engine.request_caps.remote())
    assert caps[f"{rerun[0].prompt_id}:1"] == MAX_NEW
    m = sched.metrics()
    assert (m["rollout/tail/long_rounds"], m["rollout/tail/short_rounds"], m["rollout/tail/long_queue"]) == (1, 1, 0)
    sched.mark_trained(groups)
    assert unbalance(sched.lifecycle.snapshot()) == 0
    sched.stop()


@pytest.mark.usefixtures("ray_local")
def test_over_provisioning_keeps_the_first_groups_to_finish():
    # B = 2 with over_provision 2: prompts 0, 1 regular, 2, 3 spares. Data 0 takes 10 tokens,
    # data 3 takes 8, the others 2. Prompts 1 and 2 finish first and are trained; 2 takes the slot
    # of 0 (a swap: 2 ends after 1, so 0 is the only regular group still out); the round is then full and 0 and 3 are cut into the long-prompt queue.
    lengths = {0: 10, 3: 8, 2: 3}
    sched, buffer, engine = make(lambda d, k: lengths.get(d, 2), threshold="inf", over_provision=2.0, per_token=0.05)
    sched.start()
    sched.start_admission()
    groups = take(buffer, 2)
    assert sorted(g.data_index for g in groups) == [1, 2]
    sched.quiesce()
    events = sched.drain_outcomes()
    assert sorted((e["prompt_id"], e["why"]) for e in events) == [(0, "round_full"), (3, "round_full")]
    assert sorted(ray.get(engine.log.remote())["aborted"]) == ["0:0", "0:1", "3:0", "3:1"]
    m = sched.metrics()
    assert m["rollout/tail/swaps"] == 1 and m["rollout/tail/long_queue"] == 2
    assert m["rollout/counted_admissions"] == 2 and sched.admitted == 4  # no spares after the round is full
    sched.mark_trained(groups)
    sched.set_version(1)  # 2 queued = B: a long round runs data 0 and 3 whole, with no spares
    groups = take(buffer, 2)
    assert sorted(g.data_index for g in groups) == [0, 3]
    assert sorted(len(s.response_ids) for g in groups for s in g.samples) == [8, 8, 10, 10]
    time.sleep(0.2)
    assert sched.admitted == 6
    sched.stop()


def _drive(sched, buffer, engine, steps, B, r):
    """Play the controller: the staleness rule picks each batch, then the version moves on."""
    st, trained = StalenessManager(r, B), []
    for t in range(steps):

        def select(groups, t=t):
            sched.check()
            return st.select_batch(t, [g.version for g in groups], sched.pending_versions())

        batch = buffer.get_batch(B, select=select, timeout=60)
        trained.append((t, batch))
        sched.mark_trained(batch)
        m = sched.metrics()  # spares never count: the admissions that do stay within the formula
        assert m["rollout/counted_admissions"] <= st.admission_limit(t)
        snap = {k[len("rollout/lifecycle/") :]: int(v) for k, v in m.items() if k.startswith("rollout/lifecycle/")}
        assert unbalance(snap) == 0
        if t + 1 < steps:
            ray.get(engine.set_version.remote(t + 1))
            sched.set_version(t + 1)
    sched.stop_admission()
    ray.get(engine.abort.remote(None))
    sched.quiesce()
    return trained


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("r, seed", [(0, 0), (1, 1), (2, 2), (1.5, 3)])
def test_staleness_bound_and_every_cut_prompt_trained_once_under_random_lengths(r, seed):
    """Heavy-tailed random lengths (and so random finish order): short-round responses stay within
    the threshold, the bound holds, and each cut prompt re-runs in a later long round exactly once."""
    rng = random.Random(seed)
    table = {
        (d, k): (rng.choice([2, 3, 4, 5]) if rng.random() < 0.85 else rng.randint(7, MAX_NEW))
        for d in range(400)
        for k in range(3)
    }
    B, n, steps, cap = 3, 3, 10, 6
    sched, buffer, engine = make(
        lambda d, k: table[(d, k)],
        B=B,
        r=r,
        n=n,
        per_token=0.004,
        threshold=str(cap),
        over_provision=1.5,
        long_round_queue=3,
    )
    sched.start()
    sched.start_admission()
    trained = _drive(sched, buffer, engine, steps, B, r)
    events = sched.drain_outcomes()
    leftover = sched.leftover()
    in_flight = sched.pending_ids()
    rerun_out = [sched.inflight.prompts[p].meta.get("cut_from") for p in in_flight]  # re-runs still decoding
    buffered = buffer.drain()  # with r > 0 finished groups wait for later steps
    rerun_out += [g.samples[0].meta.get("cut_from") for g in buffered]
    sched.stop()
    samples = [(t, g, s) for t, batch in trained for g in batch for s in g.samples]
    assert all(t - s.version <= math.ceil(r) for t, _, s in samples)
    assert all(len(s.response_ids) <= cap for _, _, s in samples if s.meta["round"] == "short")
    long_groups = {g.prompt_id: g for _, batch in trained for g in batch if g.samples[0].meta["round"] == "long"}
    assert any(len(s.response_ids) > cap for g in long_groups.values() for s in g.samples)  # the tail was trained
    cuts = [e for e in events if e.get("reason") == "tail_cut"]
    assert cuts and {e["why"] for e in cuts} >= {"threshold"}
    reruns = [g.samples[0].meta.get("cut_from") for g in long_groups.values()]
    queued = [x["cut_prompt_id"] for x in leftover]
    for e in cuts:  # each cut admission re-runs exactly once later (trained or still out), or is queued
        later = reruns.count(e["prompt_id"]) + rerun_out.count(e["prompt_id"]) + queued.count(e["prompt_id"])
        assert later == 1, e
    trained_data = [g.data_index for _, batch in trained for g in batch]
    assert len(trained_data) == len(set(trained_data)) == steps * B  # each prompt trained once at most
    assert not set(trained_data) & {x["data_index"] for x in leftover}
    ended = sorted(
        [g.prompt_id for _, batch in trained for g in batch]
        + [e["prompt_id"] for e in events]
        + in_flight
        + [g.prompt_id for g in buffered]
    )
    assert ended == list(range(sched.admitted))  # every admission ends exactly once
    snap = sched.lifecycle.snapshot()
    assert unbalance(snap) == 0 and snap["aborted"] == sched.metrics()["rollout/aborted/tail_cut"]


# ---- the real controller, engine and trainer ----------------------------------------------------
@pytest.fixture(scope="module")
def cache(warm_cache):
    return warm_cache


def _run_steps(cfg, steps):
    from flash.app.runner import Run

    r = Run(cfg, "tail")
    try:
        r.scheduler.start()
        r.scheduler.start_admission()
        records = r.controller.run(steps)
        r.controller.shutdown_rollout()
    finally:
        r.close()
    return r, records


@pytest.mark.slow
def test_threshold_at_infinity_is_the_plain_synchronous_loop(tmp_path, cache):
    """``threshold: inf`` with no over-provisioning cuts nothing and launches nothing extra: the
    same samples and the same losses as the textbook synchronous loop, step for step."""
    from flash.train.batch import flatten
    from tests.helpers.inproc import plain_sync_loop, small_cfg

    if ray.is_initialized():
        ray.shutdown()
    cfg = small_cfg(
        tmp_path,
        cache,
        "async_ratio=0",
        "algo.loss.name=ppo",
        "rollout.scheduler=tail_batching",
        "rollout.tail_batching.threshold=inf",
        "rollout.tail_batching.over_provision=1",
    )
    r, records = _run_steps(cfg, 3)
    ours = [([s.response_ids for s in flatten(rec.groups)], rec.metrics["train/loss"]) for rec in records]
    ref = plain_sync_loop(cfg, r.model_path, r.task, r.tokenizer, 3)
    for t, ((tok_a, loss_a), (tok_b, loss_b)) in enumerate(zip(ours, ref)):
        assert tok_a == tok_b, f"step {t}: different samples"
        assert loss_a == pytest.approx(loss_b, rel=1e-6, abs=1e-7), f"step {t}"
    assert all(rec.metrics["rollout/tail/cut_groups"] == 0 for rec in records)
    assert records[-1].metrics["rollout/tail/short_rounds"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("ratio", [0, 2])
def test_ledger_cut_prompts_rerun_in_long_rounds_exactly_once(tmp_path, cache, ratio):
    """A real engine at an absolute threshold: short-round samples stay within it, the ledger has
    every cut with its reason, each cut prompt is trained once in a long round (or is still queued
    or in flight at the end, in the ledger), every admission ends once, the bound holds."""
    import json

    if ray.is_initialized():
        ray.shutdown()
    from tests.helpers.inproc import small_cfg

    cap, steps = 8, 6
    cfg = small_cfg(
        tmp_path,
        cache,
        f"async_ratio={ratio}",
        f"train.steps={steps}",
        "rollout.scheduler=tail_batching",
        f"rollout.tail_batching.threshold={cap}",
        "rollout.tail_batching.over_provision=1.5",
        "rollout.tail_batching.long_round_queue=2",
    )
    r, records = _run_steps(cfg, steps)
    samples = [(rec.step, s) for rec in records for g in rec.groups for s in g.samples]
    assert all(len(s.response_ids) <= cap for _, s in samples if s.meta["round"] == "short")
    assert all(t - s.version <= math.ceil(ratio) for t, s in samples)
    assert any(len(s.response_ids) > cap for _, s in samples)  # long rounds trained the tail
    lines = [json.loads(x) for x in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    trained = [x for x in lines if x["outcome"] == "trained"]
    cuts = [x for x in lines if x.get("reason") == "tail_cut"]
    # the counter agrees with the ledger once rollout has stopped (with r > 0, rollout goes on after
    # the last step's metrics were taken, and its cuts are in the ledger too)
    cut_samples = sum(x["samples"] for x in cuts)
    assert cuts and r.scheduler.metrics()["rollout/aborted/tail_cut"] == cut_samples
    assert records[-1].metrics["rollout/aborted/tail_cut"] <= cut_samples
    reruns = {x["prompt_id"]: x["cut_from"] for x in trained if "cut_from" in x}
    queued = [x["cut_prompt_id"] for x in lines if x["outcome"] == "long_queue"]
    in_flight = {x["prompt_id"] for x in lines if x["outcome"] in ("in_flight", "buffered")}
    for c in cuts:
        done = list(reruns.values()).count(c["prompt_id"]) + queued.count(c["prompt_id"])
        assert done == 1 or (done == 0 and in_flight), c
    assert all(x["round"] == "long" for x in trained if "cut_from" in x)
    data = [x["data_index"] for x in trained if x["sample"] == 0]
    assert len(data) == len(set(data)) == steps * cfg.train.prompts_per_step  # each prompt trained once
    ended = sorted({x["prompt_id"] for x in trained} | {x["prompt_id"] for x in cuts} | in_flight)
    assert ended == list(range(r.scheduler.admitted))


@pytest.mark.usefixtures("ray_local")
def test_a_checkpoint_keeps_the_long_prompt_queue():
    """Cut at version 0, checkpointed, restored into a fresh scheduler: the queued prompt re-runs in
    the long round of version 1 there, once; the tail counters carry over."""
    import json

    from flash.buffers.codec import group_from_dict
    from flash.checkpoint import snapshot_rollout

    lengths = {(1, 1): 12}
    knobs = {"threshold": "4", "over_provision": 1.0, "long_round_queue": 1}
    sched, buffer, _ = make(lambda d, k: lengths.get((d, k), 3), **knobs)
    sched.start()
    sched.start_admission()
    groups = take(buffer, 2)
    sched.mark_trained(groups)
    sched.quiesce()
    state = json.loads(json.dumps(snapshot_rollout(buffer, sched)))
    sched.stop()
    assert state["scheduler"]["tail"]["long_queue"] == [{"data_index": 1, "prompt_id": 1}]

    sched2, buffer2, _ = make(lambda d, k: lengths.get((d, k), 3), **knobs)
    buffer2.restore([group_from_dict(g) for g in state["buffer"]])
    sched2.load_state_dict(state["scheduler"])
    sched2.start()
    sched2.set_version(0)  # the runner's start repeats the version: the same (short) round
    assert sched2.metrics()["rollout/tail/short_rounds"] == 1
    sched2.set_version(1)
    sched2.start_admission()
    groups = take(buffer2, 2)
    assert sorted((g.data_index, g.samples[0].meta.get("cut_from")) for g in groups) == [(1, 1), (3, None)]
    m = sched2.metrics()
    assert (m["rollout/tail/cut_groups"], m["rollout/tail/long_rounds"], m["rollout/tail/long_queue"]) == (1, 1, 0)
    assert sched2.admitted == 5  # prompt ids go on from the checkpoint's 3
    sched2.stop()


def test_the_long_prompt_queue_threshold_and_round_survive_a_state_round_trip():
    """No engine needed: the tail state (queue, round, cap, lengths, counters, spares) goes through
    JSON into a fresh scheduler, whose repeated version keeps its round and whose next version runs
    the queue as a long round; a checkpoint without that state names the setting to resume with."""
    import json

    source = PromptSource(
        item=Item, encode=lambda s: [5, int(s)], decode=lambda ids: str(len(ids)), reward=lambda item, text: 0.0
    )

    def fresh():
        return TailBatchingScheduler(
            None,
            source,
            SampleBuffer(capacity=8),
            StalenessManager(0, 2),
            SamplingParams(max_new_tokens=MAX_NEW),
            n=2,
            seed=3,
            reward_workers=1,
            tail=TailConfig(threshold="4", over_provision=1.5, long_round_queue=1),
        )

    a = fresh()
    with a._lock:  # as a cut at version 0 leaves it
        a._long.append({"data_index": 1, "prompt_id": 1})
        a._threshold.observe(7)
    state = json.loads(json.dumps(a.state_dict()))
    assert state["tail"] == {
        "long_queue": [{"data_index": 1, "prompt_id": 1}],
        "round": "short",
        "cap": 4,
        "round_version": 0,
        "lengths": [7],
        "max_additional": 1,
        "counters": {"long_rounds": 0, "short_rounds": 1, "cut_groups": 0, "swaps": 0},
    }
    b = fresh()
    b.load_state_dict(state)
    assert b.leftover() == [{"data_index": 1, "cut_prompt_id": 1, "outcome": "long_queue"}]
    b.set_version(0)  # the start repeats the checkpoint's version: the same short round, not a new one
    m = b.metrics()
    assert (m["rollout/tail/short_rounds"], m["rollout/tail/long_round"], m["rollout/tail/threshold"]) == (1, 0, 4)
    b.set_version(1)  # one prompt queued, trigger 1: a long round at full length, no spares
    m = b.metrics()
    assert (m["rollout/tail/long_rounds"], m["rollout/tail/long_round"], m["rollout/tail/threshold"]) == (1, 1, 16)
    assert b.admission.prov.max_additional == 0
    del state["tail"]
    with pytest.raises(ValueError, match="resume it with rollout.scheduler: plain"):
        fresh().load_state_dict(state)
