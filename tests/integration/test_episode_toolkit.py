"""Environment episodes run on the same scheduler core as single-turn prompts, so they get its
toolkit: redundancy (start n + k episodes, keep the first n to finish, cancel the rest and release
their environments), DAPO filters (a filtered group is counted and frees its slot) and spares
(``max_additional_prompts``), all under the staleness bound.

The engine is ``CorridorPlayer`` (scripted: a unit either walks to the goal, reward 1, or answers an
invalid action, reward 0, with a scripted delay per turn); the environments are real ``corridor``
games on real ``EnvWorker`` actors.
"""

from __future__ import annotations

import time

import pytest
import ray

from flash.buffers import SampleBuffer
from flash.controllers.episode_runtime import EpisodeScheduler
from flash.controllers.filters import FilterConfig
from flash.controllers.staleness import StalenessManager
from flash.controllers.workflows.episode import EpisodeCodec
from flash.engine.base import SamplingParams
from flash.envs.worker import start_env_workers
from flash.recipes.tasks import make_task
from tests.scripted_engine import CorridorPlayer

CODEC = EpisodeCodec(
    encode_prompt=lambda text: [ord(c) for c in text],
    encode_observation=lambda text: [ord(c) for c in text],
    decode=lambda ids: "".join(map(chr, ids)),
)


def make(delays=None, bad=(), *, B=2, r=0.0, n=2, **kw):
    task = make_task("corridor", width=8, slack=1)
    engine = ray.remote(CorridorPlayer).options(num_cpus=0, max_concurrency=8).remote(delays or {}, set(bad))
    workers = start_env_workers(2, "corridor", {"width": 8, "slack": 1})
    buffer = SampleBuffer(16)
    sched = EpisodeScheduler(
        engine,
        workers,
        task,
        CODEC,
        buffer,
        StalenessManager(r, B),
        SamplingParams(max_new_tokens=1),
        n=n,
        seed=5,
        max_turns=12,
        **kw,
    )
    sched.start()
    sched.start_admission()
    return sched, buffer, engine, workers


def take(buffer, count, timeout=60.0):
    groups = buffer.get_batch(
        count, select=lambda gs: list(range(count)) if len(gs) >= count else None, timeout=timeout
    )
    return sorted(groups, key=lambda g: g.prompt_id)


def live_envs(workers) -> float:
    return sum(ray.get(w.stats.remote())["live"] for w in workers)


def teardown(sched, engine, workers):
    sched.stop()
    for actor in (engine, *workers):
        ray.kill(actor)


@pytest.mark.usefixtures("ray_local")
def test_redundant_episodes_keep_the_first_n_and_release_the_rest():
    """n = 2 of 4 episodes per seed: 0 and 2 play fast, 1 and 3 take 2 s a turn; 1 and 3 are
    cancelled once 0 and 2 finish -- their pending turn aborted, their environments released."""
    slow = {f"{p}:{k}": 2.0 for p in range(4) for k in (1, 3)}
    sched, buffer, engine, workers = make(slow, n=2, redundancy=2)
    groups = take(buffer, 2)
    sched.stop_admission()
    sched.quiesce()
    assert [g.prompt_id for g in groups] == [0, 1]
    assert [[s.meta["request"] for s in g.samples] for g in groups] == [[0, 2], [0, 2]]
    assert all(s.reward == 1.0 and s.finish_reason == "success" for g in groups for s in g.samples)
    events = sorted((e["prompt_id"], e["request"], e["reason"]) for e in sched.drain_outcomes())
    assert events == [(0, 1, "redundant"), (0, 3, "redundant"), (1, 1, "redundant"), (1, 3, "redundant")]
    aborted = ray.get(engine.log.remote())["aborted"]
    assert sorted(a.rsplit("/", 1)[0] for a in aborted) == ["0:1", "0:3", "1:1", "1:3"]
    assert sched.counters["episodes_cancelled"] == 4
    assert sched.metrics()["rollout/aborted/redundant"] == 4.0
    assert live_envs(workers) == 0  # every environment released: the kept ones finished, the rest closed
    teardown(sched, engine, workers)


@pytest.mark.usefixtures("ray_local")
def test_filtered_episode_groups_free_their_slot_and_are_counted():
    """Seed 0's episodes all fail (rewards 0, 0): ``all_same_reward`` drops the group, counts it,
    and the slot goes to seed 2; the batch is seeds 1 and 2 (mixed rewards), all at version 0."""
    bad = {"0:0", "0:1", "1:1", "2:1"}
    sched, buffer, engine, workers = make(bad=bad, filters=FilterConfig(all_same_reward=True))
    groups = take(buffer, 2)
    time.sleep(0.3)
    assert [g.prompt_id for g in groups] == [1, 2]
    assert [g.rewards for g in groups] == [[1.0, 0.0], [1.0, 0.0]]
    assert sched.admitted == 3  # floor((0 + 1 + 0) * 2) = 2 counted, plus the one that replaced seed 0
    m = sched.metrics()
    assert m["rollout/filtered/all_same_reward"] == 1.0 and m["rollout/counted_admissions"] == 2.0
    events = sched.drain_outcomes()
    assert [(e["prompt_id"], e["outcome"], e["rule"], e["rewards"]) for e in events] == [
        (0, "filtered", "all_same_reward", [0.0, 0.0])
    ]
    assert all(s.admitted_version == 0 and set(s.versions) == {0} for g in groups for s in g.samples)
    teardown(sched, engine, workers)


@pytest.mark.usefixtures("ray_local")
def test_a_spare_episode_group_replaces_a_filtered_one_without_breaking_the_bound():
    """One spare beyond the bound: seed 2 starts while seed 0 (slow, all failing) still plays; when
    seed 0 is filtered the spare's finished group takes its slot. The next spare (seed 3) then
    waits, parked, for a slot of its version; nothing more is admitted."""
    slow = {"0:0": 0.4, "0:1": 0.4}
    bad = {"0:0", *(f"{p}:1" for p in range(8))}
    sched, buffer, engine, workers = make(
        slow, bad, filters=FilterConfig(all_same_reward=True), max_additional_prompts=1
    )
    groups = take(buffer, 2)
    time.sleep(0.5)
    assert [g.prompt_id for g in groups] == [1, 2]
    assert sched.admitted == 4 and sched.metrics()["rollout/counted_admissions"] == 2.0
    assert sched.pending_ids() == [3] and sched.pending_versions() == []  # a spare: not a trainable group
    assert sched.metrics()["rollout/filtered/all_same_reward"] == 1.0
    first_turns = [rid for rid, _ in ray.get(engine.log.remote())["submitted"] if rid.endswith("/0")]
    assert {"0:0/0", "1:0/0", "2:0/0", "3:0/0"} <= set(first_turns)
    teardown(sched, engine, workers)
