"""Sample lifecycle of the rollout scheduler: queue scheduling, redundancy, dynamic sampling.

Pure parts (lifecycle state machine, filter rules, admission accounting, the batch-then-score gate)
are tested directly. The scheduler's scheduling decisions are tested against a scripted engine
actor (tests/scripted_engine.py: exact finish times and tokens); the whole loop -- real engine,
trainer, random delays, filters, spares and redundancy on -- in tests/integration/test_controller_e2e.py.
"""

import math
import random
import time
from dataclasses import dataclass

import pytest
import ray

from flash.buffers import SampleBuffer
from flash.controllers.filters import FilterConfig, check_filter, filter_reason, reward_std
from flash.controllers.lifecycle import IllegalTransition, Lifecycle, unbalance
from flash.controllers.provisioning import Provisioning, WaveGate
from flash.controllers.scheduler import PromptSource, RolloutScheduler, request_seed
from flash.controllers.staleness import StalenessManager
from flash.engine.base import SamplingParams
from tests.helpers.waiting import wait_until
from tests.scripted_engine import ScriptedEngine


# ---- pure parts ----------------------------------------------------------------------------
def test_lifecycle_counts_and_rejects_illegal_moves():
    lc = Lifecycle()
    ids = [f"0:{k}" for k in range(3)]
    lc.admit(ids)
    lc.move(ids, "generating")
    lc.move(ids[:2], "scoring")
    lc.abort([ids[2]], "redundant", [{"prompt_id": 0, "request": 2}])
    with pytest.raises(IllegalTransition):
        lc.move(ids[:2], "trained")  # scoring -> trained skips buffered
    with pytest.raises(IllegalTransition):
        lc.move([ids[2]], "scoring")  # an aborted sample is gone
    with pytest.raises(IllegalTransition):
        lc.admit([ids[0]])
    lc.move(ids[:2], "buffered")
    lc.move(ids[:1], "trained")
    snap = lc.snapshot()
    assert snap == {
        "admitted": 3,
        "generating": 3,
        "scoring": 2,
        "buffered": 2,
        "trained": 1,
        "filtered": 0,
        "aborted": 1,
        "admitted_now": 0,
        "generating_now": 0,
        "scoring_now": 0,
        "buffered_now": 1,
    }
    assert unbalance(snap) == 0
    assert lc.metrics()["rollout/aborted/redundant"] == 1.0
    assert lc.drain_events() == [{"prompt_id": 0, "request": 2, "outcome": "aborted", "reason": "redundant"}]
    assert lc.drain_events() == []


def test_filter_rules_in_order_with_hand_computed_values():
    cfg = FilterConfig(all_same_reward=True, min_reward_std=0.2, max_response_len=5)
    assert reward_std([0.4, 0.6]) == pytest.approx(0.1)
    assert reward_std([0.0, 1.0, 1.0, 1.0]) == pytest.approx(0.4330127)  # sqrt(3)/4
    assert filter_reason([1.0, 1.0], [9, 9], cfg) == "all_same_reward"  # first rule wins
    assert filter_reason([0.4, 0.6], [9, 9], cfg) == "reward_std"
    assert filter_reason([0.0, 1.0], [3, 6], cfg) == "length"
    assert filter_reason([0.0, 1.0], [3, 5], cfg) is None  # 5 is not over the limit
    assert filter_reason([1.0, 1.0], [3], FilterConfig()) is None  # all off
    assert filter_reason([1.0, 1.0], [3], FilterConfig(min_reward_std=0.01)) == "reward_std"
    assert "rollout.n >= 2" in check_filter(FilterConfig(all_same_reward=True), 1, 40)
    assert "lower it or set 0" in check_filter(FilterConfig(max_response_len=40), 4, 40)


def test_filtered_groups_free_slots_and_spares_promote_only_at_their_version():
    prov = Provisioning(StalenessManager(0, 2), max_additional=1)
    assert prov.next_action(0) == ("admit", None)
    prov.admitted(0, 0, spare=False)
    prov.admitted(1, 0, spare=False)
    assert prov.next_action(0) == ("spare", None)  # bound reached (2 = floor(1 * 2))
    prov.admitted(2, 0, spare=True)
    assert prov.next_action(0) is None
    prov.filtered(0)  # a regular group filtered: its slot is free, the spare takes it
    assert prov.next_action(0) == ("promote", 2)
    prov.promote(2)
    assert prov.counted == 2 and prov.next_action(0) == ("spare", None)
    prov.admitted(3, 0, spare=True)
    prov.admitted(4, 1, spare=False)  # (as if the version moved on: limit 4)
    assert prov.next_action(1) == ("admit", None)  # spare 3 is of version 0: never promoted at 1
    assert prov.expire(1) == [3] and not prov.is_spare(3)
    prov.filtered(4)
    assert prov.counted == 2


def _simulate(r: float, B: int, spares: int, p_filter: float, steps: int, seed: int) -> int:
    """The scheduler's admission and the controller's batch selection as a discrete-event run:
    groups finish in random order, a fraction is filtered; a group's version is its admission
    version (the oldest it can be). Returns the largest staleness trained; asserts liveness."""
    rng, st = random.Random(seed), StalenessManager(r, B)
    prov, version = Provisioning(st, spares), 0
    versions: dict[int, int] = {}
    inflight, parked, buffer, worst = [], [], [], 0

    def admit():
        while (action := prov.next_action(version)) is not None:
            kind, pid = action
            if kind == "promote":
                prov.promote(pid)
                if pid in parked:
                    parked.remove(pid)
                    buffer.append(pid)
            else:
                pid = len(versions)
                versions[pid] = version
                prov.admitted(pid, version, spare=kind == "spare")
                inflight.append(pid)

    for t in range(steps):
        admit()
        while (
            pick := st.select_batch(
                t, [versions[p] for p in buffer], [versions[p] for p in inflight if not prov.is_spare(p)]
            )
        ) is None:
            assert any(not prov.is_spare(p) for p in inflight), "no trainable group left: deadlock"
            pid = inflight.pop(rng.randrange(len(inflight)))
            if rng.random() < p_filter:
                prov.filtered(pid)
            elif prov.is_spare(pid):
                prov.spare_finished(pid)
                parked.append(pid)
            else:
                buffer.append(pid)
            admit()
        worst = max([worst] + [t - versions[buffer[i]] for i in pick])
        buffer = [b for i, b in enumerate(buffer) if i not in pick]
        version = t + 1
        for pid in prov.expire(version):
            (inflight if pid in inflight else parked).remove(pid)
        assert prov.counted == (t + 1) * B + len(buffer) + sum(not prov.is_spare(p) for p in inflight)
    return worst


@pytest.mark.parametrize("r", [0, 0.5, 1, 2, 2.5])
@pytest.mark.parametrize("spares, p_filter", [(0, 0.0), (0, 0.5), (3, 0.3), (2, 0.8)])
def test_staleness_bound_holds_with_filtering_and_spares(r, spares, p_filter):
    """Counting only trainable groups (filtered ones free their slot) keeps the bound and never
    starves the batch, whatever the finishing order and filtering; 30 random schedules each."""
    worst = max(_simulate(r, 3, spares, p_filter, steps=12, seed=s) for s in range(30))
    assert worst == math.ceil(r)  # never beyond the bound, and the schedules do reach it


def test_wave_gate_holds_a_wave_until_every_request_ended():
    gate = WaveGate(queue=False)
    gate.open(0, 3)
    assert gate.finished(0, "a") == []
    assert gate.resolved(0, 1) == []  # an aborted request
    assert gate.finished(0, "b") == ["a", "b"]
    assert gate.held() == 0
    assert WaveGate(queue=True).finished(7, "x") == ["x"]


# ---- the scheduler against a scripted engine -----------------------------------------------
@dataclass
class Item:
    index: int
    prompt: str = "p"


def scripted(delays, default=0.05, lengths=None):
    return ray.remote(ScriptedEngine).options(num_cpus=0, max_concurrency=8).remote(delays, default, lengths)


def make(engine, rewards=None, *, B=2, r=0.0, n=2, workers=4, sleep_s=0.0, **kw):
    """A scheduler whose reward is ``rewards[(data index, request index)]`` (0 if absent)."""
    rewards = rewards or {}

    def reward(item, text):
        time.sleep(sleep_s)
        return rewards.get((item.index, int(text.split(",")[0]) - 1), 0.0)

    source = PromptSource(item=Item, encode=lambda s: [5, 6], decode=lambda ids: ",".join(map(str, ids)), reward=reward)
    buffer = SampleBuffer(capacity=16)
    sched = RolloutScheduler(
        engine,
        source,
        buffer,
        StalenessManager(r, B),
        SamplingParams(max_new_tokens=8),
        n=n,
        seed=3,
        reward_workers=workers,
        **kw,
    )
    return sched, buffer


def take(buffer, count, timeout=30.0):
    return buffer.get_batch(count, select=lambda gs: list(range(count)) if len(gs) >= count else None, timeout=timeout)


def _rollout_time(queue: bool, B: int, n: int, gap: float, sleep_s: float) -> tuple[float, float, float]:
    """(seconds to B buffered groups, generation seconds, summed scoring seconds), one worker."""
    ids = [f"{p}:{k}" for p in range(B) for k in range(n)]
    engine = scripted({rid: gap * (j + 1) for j, rid in enumerate(ids)})
    sched, buffer = make(engine, B=B, n=n, workers=1, sleep_s=sleep_s, queue_scheduling=queue)
    ray.get(engine.log.remote())  # the actor is up: time only the rollout
    sched.start()
    t0 = time.time()
    sched.start_admission()
    take(buffer, B)
    took = time.time() - t0
    gen = max(t for _, t in ray.get(engine.log.remote())["delivered"]) - t0
    score = sched.counters["reward_seconds"]
    sched.stop()
    return took, gen, score


@pytest.mark.usefixtures("ray_local")
def test_queue_scheduling_overlaps_scoring_with_generation():
    """Responses finish 0.2 s apart (1.6 s of generation); each takes 0.2 s to score (1.6 s of
    scoring on one worker). Scored on arrival, the batch is ready one score after the last
    response: ~max(gen, score); batch-then-score can be no faster than gen + score."""
    s = 0.2
    q_took, q_gen, q_score = _rollout_time(True, B=2, n=4, gap=0.2, sleep_s=s)
    b_took, b_gen, b_score = _rollout_time(False, B=2, n=4, gap=0.2, sleep_s=s)
    assert q_took >= max(q_gen, q_score)
    assert q_took <= max(q_gen, q_score) + s + 0.4, (q_took, q_gen, q_score)
    assert q_took < 0.75 * (q_gen + q_score), (q_took, q_gen, q_score)
    assert b_took >= b_gen + b_score - 0.02, (b_took, b_gen, b_score)
    assert q_took < 0.75 * b_took


@pytest.mark.usefixtures("ray_local")
def test_redundancy_keeps_first_n_aborts_the_rest_never_buffers_them():
    # prompt 0: requests 0 and 2 finish first, 1 and 3 are still running -> aborted in the engine;
    # prompt 1: all four finish together -> 0 and 1 kept, 2 and 3 arrive after the abort decision.
    delays = {"0:0": 0.1, "0:1": 5.0, "0:2": 0.2, "0:3": 5.0, **{f"1:{k}": 0.3 for k in range(4)}}
    engine = scripted(delays)
    rewards = {(0, 0): 1.0, (0, 2): 0.5, (1, 0): 0.25, (1, 1): 0.75}
    sched, buffer = make(engine, rewards, B=2, n=2, redundancy=2)
    sched.start()
    sched.start_admission()
    groups = sorted(take(buffer, 2), key=lambda g: g.prompt_id)
    sched.quiesce()
    log = ray.get(engine.log.remote())
    assert [[s.meta["request"] for s in g.samples] for g in groups] == [[0, 2], [0, 1]]
    assert [[s.sample_index for s in g.samples] for g in groups] == [[0, 1], [0, 1]]
    assert [g.rewards for g in groups] == [[1.0, 0.5], [0.25, 0.75]]
    assert sorted(log["aborted"]) == ["0:1", "0:3"]  # the engine stopped the slow ones
    assert sched.counters["late_outputs"] == 2  # 1:2 and 1:3 finished but were already aborted
    events = sched.drain_outcomes()
    assert sorted((e["prompt_id"], e["request"]) for e in events) == [(0, 1), (0, 3), (1, 2), (1, 3)]
    assert all(e["outcome"] == "aborted" and e["reason"] == "redundant" for e in events)
    # replication: every sample is its own request with its own seed
    assert sorted(log["submitted"]) == sorted((f"{p}:{k}", request_seed(3, p, k)) for p in range(2) for k in range(4))
    assert len({seed for _, seed in log["submitted"]}) == 8
    sched.mark_trained(groups)
    snap = sched.lifecycle.snapshot()
    assert (snap["admitted"], snap["scoring"], snap["buffered"], snap["trained"], snap["aborted"]) == (8, 4, 4, 4, 4)
    assert unbalance(snap) == 0 and snap["generating_now"] == snap["scoring_now"] == 0
    sched.stop()


@pytest.mark.usefixtures("ray_local")
def test_filters_count_by_rule_and_refill_the_batch():
    rewards = {(0, 0): 1.0, (0, 1): 1.0, (1, 1): 1.0, (2, 0): 0.4, (2, 1): 0.6, (3, 1): 1.0, (4, 0): 1.0}
    engine = scripted({}, lengths={"3:0": 9, "3:1": 9})
    f = FilterConfig(all_same_reward=True, min_reward_std=0.2, max_response_len=5)
    sched, buffer = make(engine, rewards, B=2, n=2, filters=f)
    sched.start()
    sched.start_admission()
    groups = take(buffer, 2)
    sched.quiesce()
    assert sorted(g.data_index for g in groups) == [1, 4]
    m = sched.metrics()
    assert {k: v for k, v in m.items() if k.startswith(("rollout/filtered/", "rollout/aborted/"))} == {
        "rollout/filtered/all_same_reward": 1.0,
        "rollout/filtered/reward_std": 1.0,
        "rollout/filtered/length": 1.0,
        "rollout/aborted/redundant": 0.0,
        "rollout/aborted/surplus": 0.0,
    }
    assert m["rollout/lifecycle/filtered"] == 6.0 and m["rollout/lifecycle/buffered"] == 4.0
    assert m["rollout/counted_admissions"] == 2.0  # filtered groups do not count: 2 = floor(1 * B)
    events = sorted(sched.drain_outcomes(), key=lambda e: e["prompt_id"])
    assert [(e["prompt_id"], e["rule"], e["rewards"]) for e in events] == [
        (0, "all_same_reward", [1.0, 1.0]),
        (2, "reward_std", [0.4, 0.6]),
        (3, "length", [0.0, 1.0]),
    ]
    time.sleep(0.3)
    assert sched.admitted == 5  # the bound is reached: nothing more is admitted at version 0
    sched.stop()


@pytest.mark.usefixtures("ray_local")
def test_spares_fill_a_filtered_slot_and_expire_at_the_next_version():
    # prompt 0 (regular) is slow and all-same; prompt 1 (spare) finishes first and waits, unseen
    engine = scripted({"0:0": 1.0, "0:1": 1.0, "1:0": 0.05, "1:1": 0.05}, default=30.0)
    rewards = {(0, 0): 1.0, (0, 1): 1.0, (1, 1): 1.0}
    sched, buffer = make(
        engine, rewards, B=1, n=2, filters=FilterConfig(all_same_reward=True), max_additional_prompts=1
    )
    sched.start()
    sched.start_admission()
    wait_until(lambda: sched.lifecycle.snapshot()["scoring_now"] == 2, timeout=30.0)
    time.sleep(0.1)
    assert len(buffer) == 0 and sched.pending_versions() == [0]  # the spare is not trainable yet
    (group,) = take(buffer, 1)
    assert group.prompt_id == 1  # promoted into the slot prompt 0's filtering freed
    wait_until(lambda: sched.admitted == 3, timeout=30.0)  # a new spare (prompt 2) replaces the promoted one
    assert sched.pending_versions() == [] and sched.pending_ids() == [2]
    sched.set_version(1)  # spare 2 (version 0) can no longer be promoted: aborted as surplus
    assert sorted(ray.get(engine.log.remote())["aborted"]) == ["2:0", "2:1"]
    events = sched.drain_outcomes()
    assert [(e["prompt_id"], e["outcome"], e.get("rule") or e.get("reason")) for e in events] == [
        (0, "filtered", "all_same_reward"),
        (2, "aborted", "surplus"),
    ]
    assert sched.lifecycle.aborted["surplus"] == 2
    wait_until(lambda: sched.admitted == 5, timeout=30.0)  # version 1: one regular (3) and one spare (4)
    assert sched.pending_versions() == [1]
    assert unbalance(sched.lifecycle.snapshot()) == 0
    sched.stop()


def test_checkpoint_restarts_prompts_in_flight_once_and_keeps_the_lifecycle_balanced(ray_local):
    """A checkpoint mid-flight (flash.checkpoint.snapshot_rollout): buffered groups come back as
    they were; prompts in flight restart with the same ids and seeds; the lifecycle counts each
    sample once (``admitted = ended + live``), redundant requests included."""
    import json

    from flash.buffers.codec import group_from_dict
    from flash.checkpoint import snapshot_rollout

    slow = {f"{p}:{k}": 5.0 for p in (2, 3) for k in range(3)}
    sched, buffer = make(scripted(slow), B=2, r=1, n=2, redundancy=1)
    sched.start()
    sched.start_admission()
    wait_until(lambda: len(buffer) >= 2, timeout=30.0)  # prompts 0 and 1 buffered, 2 and 3 still generating
    state = json.loads(json.dumps(snapshot_rollout(buffer, sched)))
    sched.stop()
    assert sorted(g["prompt_id"] for g in state["buffer"]) == [0, 1]
    assert [p["prompt_id"] for p in state["scheduler"]["pending"]] == [2, 3]

    engine = scripted({})
    sched2, buffer2 = make(engine, B=2, r=1, n=2, redundancy=1)
    buffer2.restore([group_from_dict(g) for g in state["buffer"]])
    assert sched2.load_state_dict(state["scheduler"]) == 2
    sched2.start()
    groups = take(buffer2, 4)
    sched2.mark_trained(groups)
    sched2.stop()
    assert sorted(g.prompt_id for g in groups) == [0, 1, 2, 3]
    assert sorted(g.data_index for g in groups) == [0, 1, 2, 3]
    resubmitted = ray.get(engine.log.remote())["submitted"]
    assert sorted(rid for rid, _ in resubmitted) == [f"{p}:{k}" for p in (2, 3) for k in range(3)]
    assert all(seed == request_seed(3, *map(int, rid.split(":"))) for rid, seed in resubmitted)
    snap = sched2.lifecycle.snapshot()
    assert unbalance(snap) == 0
    assert snap["admitted"] == 4 * 3 and snap["trained"] == 4 * 2 and snap["aborted"] == 4
    assert sched2.metrics()["rollout/counted_admissions"] == 4.0


@pytest.mark.usefixtures("ray_local")
def test_evaluation_scores_its_responses_concurrently():
    """8 held-out responses, each 0.3 s to score, 4 reward threads: scored side by side the
    evaluation takes about 2 × 0.3 s after generation; one after another it would take 2.4 s."""
    engine = scripted({}, default=0.05)
    sched, _ = make(engine, workers=4, sleep_s=0.3)
    items = [Item(i) for i in range(8)]
    ray.get(engine.log.remote())  # the actor is up: time only the evaluation
    sched.start()
    t0 = time.monotonic()
    rewards = sched.evaluate(items, SamplingParams(max_new_tokens=8), tag="t", seed=1)
    took = time.monotonic() - t0
    sched.stop()
    assert rewards == [0.0] * 8
    assert 2 * 0.3 <= took < 0.6 * 8 * 0.3, took


@pytest.mark.usefixtures("ray_local")
def test_requests_an_engine_lost_are_asked_again_and_a_second_output_is_dropped():
    """After an engine restart the scheduler submits again what is still generating (of the ids
    given, or all), with the same seeds; an output for a request already taken is counted, not used."""
    from flash.engine.base import GenerationOutput

    engine = scripted({"0:0": 0.6, "0:1": 0.05, "1:0": 0.6, "1:1": 0.6})
    sched, buffer = make(engine, B=2, n=2)
    sched.start()
    sched.start_admission()
    wait_until(lambda: sched.lifecycle.snapshot()["generating_now"] == 3, timeout=30.0)  # 0:1 finished
    assert sched.requeue_lost(["1:0", "0:1"]) == 1  # 0:1 is taken: only 1:0 is asked again
    assert sched.requeue_lost() == 3
    groups = take(buffer, 2)
    submitted = [rid for rid, _ in ray.get(engine.log.remote())["submitted"]]
    assert {rid: submitted.count(rid) for rid in sorted(set(submitted))} == {"0:0": 2, "0:1": 1, "1:0": 3, "1:1": 2}
    assert len(set(ray.get(engine.log.remote())["submitted"])) == 4  # each request kept its seed
    before = sched.lifecycle.snapshot()
    sched.deliver([GenerationOutput("0:0", [5, 6], [1, 1, 1], [-0.5] * 3, [0] * 3, "stop")])
    assert sched.counters["duplicate_outputs"] == 1 and sched.lifecycle.snapshot() == before
    assert sorted(g.prompt_id for g in groups) == [0, 1]
    sched.stop()


def test_a_second_init_ray_keeps_the_running_ray(ray_local):
    from flash.cluster import init_ray

    node = ray.get_runtime_context().get_node_id()
    init_ray(None, num_cpus=8, num_gpus=4)  # already started: nothing is started or joined
    assert ray.get_runtime_context().get_node_id() == node
    assert ray.cluster_resources()["CPU"] == 2 and "GPU" not in ray.cluster_resources()
