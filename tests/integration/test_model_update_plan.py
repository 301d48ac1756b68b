"""Model update's pure parts, pinned with hand-computed numbers (no Ray): the bucket plan's offsets
and sizes, pack/unpack of mixed dtypes, tied weights sent once, shared-memory segments (and stale
ones swept), the pre-collective plan check, the backend choice and the config section. (The group
on Ray actors: test_model_update.py.)"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from flash.app.config import ConfigError, load_config
from flash.models import build_tiny_model, build_tokenizer
from flash.weights.group import choose_backend
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
from tests.helpers.models import TINY


def test_plan_buckets_offsets_and_sizes_by_hand():
    entries = [
        (("a",), (10,), "float32"),
        (("b",), (3,), "float16"),
        (("c",), (100,), "float32"),
        (("d",), (4,), "int64"),
    ]
    metas = plan_buckets(entries, bucket_bytes=128)
    # a: 40 B at 0; b: 6 B at 64 (40 aligned up); c: 400 B > 128 -> its own bucket; d: 32 B -> next
    assert [(m.names, m.bucket, m.offset, m.nbytes) for m in metas] == [
        (("a",), 0, 0, 40),
        (("b",), 0, 64, 6),
        (("c",), 1, 0, 400),
        (("d",), 2, 0, 32),
    ]
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
    tensors = {
        "w": torch.randn(5, 7, generator=g),
        "h": torch.randn(9, generator=g).half(),
        "b": torch.randn(3, 3, generator=g).bfloat16(),
        "i": torch.arange(-4, 7),
        "t": torch.randn(6, 4, generator=g).t(),
    }  # non-contiguous
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
