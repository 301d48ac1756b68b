"""Router: the pure load balancer with hand-computed routes, then two real torch-engine replicas
(tiny Qwen2, hidden 64) behind one Router actor: every request answered exactly once, prompt
affinity, pause → update → resume across replicas, abort on the owner, a dead replica named."""

from __future__ import annotations

import os
import time
from collections import Counter

import pytest
import ray
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from flash.engine.base import GenerationRequest, SamplingParams
from flash.engine.router import LoadBalancer, ReplicaError, merge_spans, start_router
from flash.engine.torch_engine import TorchEngine
from flash.cluster import wait_ready
from flash.engine.torch_worker import start_engine


def req(rid: str, prompt: list[int], n: int = 8, temperature: float = 0.0) -> GenerationRequest:
    return GenerationRequest(rid, list(prompt), SamplingParams(max_new_tokens=n, temperature=temperature))


# ---- LoadBalancer (pure) -----------------------------------------------------------------------
def test_least_loaded_by_token_cost():
    lb = LoadBalancer(3)
    # costs = len(prompt) + max_new_tokens: 10, 10, 30, 5, 5
    reqs = [req("a", [1, 2], 8), req("b", [1, 2], 8), req("c", [1, 2], 28), req("d", [1], 4), req("e", [1], 4)]
    # a→0 (all empty); b→1; c→2; d: loads [10,10,30], tie on load and count → lowest index 0;
    # e: loads [15,10,30] → 1
    assert lb.assign(reqs) == [0, 1, 2, 0, 1]
    assert lb.load == [15, 15, 30] and lb.count == [2, 2, 1] and lb.outstanding == 5
    lb.done(["c", "unknown-id"])
    assert lb.load == [15, 15, 0] and lb.owner("c") is None and lb.owner("d") == 0
    assert lb.assign([req("f", [1], 4)]) == [2]
    with pytest.raises(ValueError, match="request 'a' is already in flight"):
        lb.assign([req("a", [3], 4)])
    with pytest.raises(ValueError, match="request 'g' is already in flight"):
        lb.assign([req("g", [3], 4), req("g", [3], 4)])
    assert lb.routed == [2, 2, 2]


def test_affinity_keeps_a_prompt_on_one_replica_while_it_is_out():
    lb = LoadBalancer(2, affinity=True)
    A, B, C = [1, 1], [2, 2], [3, 3]  # cost of each request: 2 + 8 = 10
    batch = [req("A0", A), req("B0", B), req("A1", A), req("B1", B), req("A2", A), req("B2", B)]
    assert lb.assign(batch) == [0, 1, 0, 1, 0, 1]  # A first → 0 (empty), then B → 1
    assert lb.load == [30, 30]
    assert lb.assign([req("C0", C)]) == [0]  # tie → index 0; load [40, 30]
    lb.done(["A0", "A1", "A2"])  # A has left: unpinned; load [10, 30]
    assert lb.assign([req("A3", A)]) == [0]  # least loaded again
    assert lb.assign([req("B3", B)]) == [1]  # pinned: B1/B2 are still out on 1, though 1 is heavier
    lb.done(["B0", "B1", "B2", "B3"])  # load [20, 0]
    assert lb.assign([req("B4", B), req("C1", C)]) == [1, 0]  # B free again → 1; C pinned → 0


def test_replicas_out_of_service_get_nothing_and_hand_back_what_they_held():
    lb = LoadBalancer(2, affinity=True)
    A, B = [1, 1], [2, 2]  # cost 10 each
    assert lb.assign([req("A0", A), req("B0", B), req("A1", A)]) == [0, 1, 0]
    lb.down.add(0)  # Router.replica_down(0): what 0 held comes back, unpinned
    lost = lb.outstanding_on(0)
    lb.done(lost)
    assert lost == ["A0", "A1"] and lb.load == [0, 10] and lb.owner("A0") is None
    assert lb.assign([req("A0", A), req("A1", A), req("C0", [3])]) == [1, 1, 1]  # only 1 in service
    lb.down.add(1)
    with pytest.raises(ReplicaError, match="no engine replica is in service"):
        lb.assign([req("D0", [4])])
    lb.down.clear()  # replica_up
    assert lb.assign([req("D0", [4])]) == [0]


def test_replica_error_keeps_its_replica_and_kind_across_pickling():
    import pickle

    err = pickle.loads(pickle.dumps(ReplicaError("engine replica 1 failed in get_finished: x", 1, "hung")))
    assert (str(err), err.replica, err.kind) == ("engine replica 1 failed in get_finished: x", 1, "hung")


def test_merge_spans_is_the_union():
    assert merge_spans([[5, 6], [1, 3], [2, 4], [4, 4.5]]) == [[1, 4.5], [5, 6]]
    assert merge_spans([]) == []


# ---- two real engine replicas behind a Router --------------------------------------------------
def tiny_model(seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        initializer_range=0.2,
        max_position_embeddings=256,
    )
    return Qwen2ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_model(0).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def replicas(model_dir):
    ray.shutdown()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        logging_level="ERROR",
        runtime_env={"env_vars": {"PYTHONPATH": os.getcwd(), "OMP_WAIT_POLICY": "PASSIVE"}},
    )
    engines = [start_engine(model_dir, max_num_seqs=8, seed=0, threads=1) for _ in range(2)]
    wait_ready(*engines)
    yield engines
    ray.shutdown()


def collect(router, ids: list[str], timeout: float = 120.0) -> list:
    outs, deadline = [], time.monotonic() + timeout
    while len(outs) < len(ids):
        assert time.monotonic() < deadline, f"only {len(outs)} of {len(ids)} answered"
        outs += ray.get(router.get_finished.remote(0.2))
    return outs


def solo_greedy(model, requests) -> dict[str, list[int]]:
    return {o.request_id: o.token_ids for o in TorchEngine(model, max_num_seqs=8).generate(requests)}


PROMPTS = [[1, 2, 3], [5], [9, 8, 7, 6], [11, 12], [4, 4, 4, 4, 4], [7, 1], [30, 31, 32], [60]]


def test_spreads_by_load_and_answers_each_request_once(replicas):
    router = start_router(replicas)
    reqs = [req(f"s{i}", p, n=10) for i, p in enumerate(PROMPTS)]
    # equal costs would alternate; these differ: cost = len(prompt) + 10
    ray.get(router.submit.remote(reqs))
    routes = ray.get(router.routes.remote([r.request_id for r in reqs]))
    expected = LoadBalancer(2).assign(reqs)
    assert routes == expected and sorted(Counter(routes).values()) == [4, 4]
    outs = collect(router, [r.request_id for r in reqs])
    assert Counter(o.request_id for o in outs) == Counter(r.request_id for r in reqs)  # each exactly once
    assert {o.request_id: o.token_ids for o in outs} == solo_greedy(tiny_model(0), reqs)
    assert ray.get(router.get_finished.remote(0.2)) == []
    stats = ray.get(router.stats.remote())
    assert stats["replicas"] == 2 and stats["replica0/outstanding"] == stats["replica1/outstanding"] == 0
    assert stats["tokens_generated"] == 8 * 10 and stats["version"] == 0


def test_prompt_affinity_keeps_each_group_on_one_replica(replicas):
    router = start_router(replicas, prompt_affinity=True)
    reqs = [req(f"g{p}:{k}", PROMPTS[p], n=6, temperature=1.0) for k in range(4) for p in range(5)]
    ray.get(router.submit.remote(reqs))
    routes = ray.get(router.routes.remote([r.request_id for r in reqs]))
    by_group: dict[int, set] = {}
    for r, where in zip(reqs, routes):
        by_group.setdefault(int(r.request_id[1:].split(":")[0]), set()).add(where)
    assert all(len(s) == 1 for s in by_group.values())  # a group never splits
    # groups in order of first appearance, a group's 4 requests added at once; group costs
    # 4·(len+6) = 36, 28, 40, 32, 44: g0→0 [36,0]; g1→1 [36,28]; g2→1 [36,68]; g3→0 [68,68];
    # g4: tie on load and count → 0
    assert [by_group[g].pop() for g in range(5)] == [0, 1, 1, 0, 0]
    outs = collect(router, [r.request_id for r in reqs])
    assert sorted(o.request_id for o in outs) == sorted(r.request_id for r in reqs)


def test_pause_update_resume_reaches_every_replica(replicas):
    router = start_router(replicas)
    long = [req(f"u{i}", PROMPTS[i], n=200) for i in range(4)]
    ray.get(router.submit.remote(long))
    ray.get(router.pause.remote("continue"))
    new = tiny_model(1)
    nbytes = ray.get(router.update_weights.remote(new.state_dict(), 1))
    assert nbytes == 2 * sum(t.numel() * t.element_size() for t in new.state_dict().values())
    assert ray.get([r.version.remote() for r in replicas]) == [1, 1] and ray.get(router.version.remote()) == 1
    ray.get(router.resume.remote())
    outs = collect(router, [r.request_id for r in long])
    for o in outs:  # versions never go back; the last token came from the new weights
        assert len(o.token_ids) == 200 and o.versions == sorted(o.versions) and o.versions[-1] == 1
    probe = [req(f"w{i}", PROMPTS[i], n=12) for i in range(2)]  # one per replica (empty: 0 then 1)
    ray.get(router.submit.remote(probe))
    assert ray.get(router.routes.remote(["w0", "w1"])) == [0, 1]
    got = {o.request_id: o.token_ids for o in collect(router, ["w0", "w1"])}
    assert got == solo_greedy(new, probe)  # both replicas now compute with the pushed weights


def test_abort_goes_to_the_owner(replicas):
    router = start_router(replicas)
    reqs = [req(f"a{i}", PROMPTS[i], n=200) for i in range(4)]
    ray.get(router.submit.remote(reqs))
    # costs 203, 201, 204, 202: a0→0, a1→1, a2→1 [203, 405], a3→0; abort one on each replica
    assert ray.get(router.routes.remote(["a0", "a1", "a2", "a3"])) == [0, 1, 1, 0]
    aborted = ray.get(router.abort.remote(["a1", "a3", "not-a-request"]))
    assert sorted(o.request_id for o in aborted) == ["a1", "a3"]
    assert {o.finish_reason for o in aborted} == {"abort"}
    assert ray.get(router.routes.remote(["a0", "a1", "a2", "a3"])) == [0, None, 1, None]
    outs = collect(router, ["a0", "a2"])
    assert sorted(o.request_id for o in outs) == ["a0", "a2"] and all(len(o.token_ids) == 200 for o in outs)


def test_sleep_and_wake_up_fan_out(replicas):
    router = start_router(replicas)
    reqs = [req(f"z{i}", PROMPTS[i], n=60) for i in range(2)]
    ray.get(router.submit.remote(reqs))
    ray.get(router.pause.remote("continue"))
    freed = ray.get(router.sleep.remote())
    assert [f["weights"] for f in freed["replicas"]] == ["kept", "kept"]  # CPU: only the KV cache goes
    assert [s["asleep"] for s in ray.get([r.stats.remote() for r in replicas])] == [1.0, 1.0]
    with pytest.raises(ray.exceptions.RayTaskError, match="engine replica 0 failed in resume.*asleep"):
        ray.get(router.resume.remote())
    ray.get(router.wake_up.remote())
    ray.get(router.resume.remote())
    assert sorted(o.request_id for o in collect(router, ["z0", "z1"])) == ["z0", "z1"]


def test_a_dead_replica_is_named(replicas):  # last: it kills replica 1
    router = start_router(replicas)
    ray.kill(replicas[1])
    with pytest.raises(ray.exceptions.RayTaskError, match="engine replica 1 failed in get_finished"):
        for _ in range(50):
            ray.get(router.get_finished.remote(0.1))
    with pytest.raises(ray.exceptions.RayTaskError, match="engine replica 1 failed in pause"):
        ray.get(router.pause.remote("continue"))
    assert issubclass(ReplicaError, RuntimeError)
