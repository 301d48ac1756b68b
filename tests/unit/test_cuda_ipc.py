"""The ``cuda_ipc`` weight push (flash.weights.cuda_ipc) on CPU tensors.

Only exporting and opening the IPC handle need CUDA; here they are replaced by an in-process
registry (the "handle" is a key to the sender's very tensor, as a mapped IPC buffer is the
sender's memory), so the rest -- the group's sender and receiver hooks, the plan with the
replicas' dtypes, the pack into one flat buffer, the views copied into a live engine, the mapping
cached per buffer and dropped at close -- runs as it runs on a GPU. The real handles are tested on
a GPU (tests/gpu/test_colocated_push.py).

The 1-GPU path's push names no host memory: the single trainer packs its live parameters, cast
in the copy into the buffer; an FSDP2 rank gathers its shards cast to the engine's dtype and
keeps the full tensors on its device (``HostCopies`` counts every copy that names the host).
"""

from __future__ import annotations

import pytest
import torch

from flash.engine.torch_engine import TorchEngine
from flash.weights import cuda_ipc
from flash.weights.group import UpdateReceiver, UpdateSender
from flash.weights.model_update import (
    ModelUpdateError,
    agreed_dtypes,
    as_bytes,
    plan_state,
    unique_tensors,
    unpack_flat,
)
from tests.helpers.host_reads import HostCopies
from tests.helpers.models import TINY, make_model, save_tiny
from tests.helpers.train import settings

HOST, TIMEOUT_S = "127.0.0.1", 30.0


class Sender(UpdateSender):
    def __init__(self, model):
        self.model = model

    def _mu_state(self) -> dict:
        return self.model.state_dict()


class Replica(UpdateReceiver):
    """The torch engine's receiver hooks (as ``flash.engine.torch_worker.EngineWorker``'s)."""

    def __init__(self, model):
        self.model, self.engine = model, TorchEngine(model, max_num_seqs=2)

    def _mu_device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _mu_shapes(self) -> dict:
        return {k: tuple(v.shape) for k, v in self.model.state_dict().items()}

    def _mu_ties(self) -> list:
        return [names for names, _ in unique_tensors(self.model.state_dict()) if len(names) > 1]

    def _mu_targets(self) -> dict:
        return self.model.state_dict()

    def _mu_apply(self, items, version: int) -> None:
        self.engine.update_weights(items, version)


@pytest.fixture
def handles(monkeypatch):
    """Handles to buffers of this process: ``opened`` counts the mappings a receiver made."""
    buffers, opened = {}, []

    def export(flat):
        buffers[id(flat)] = flat
        return ("local", id(flat))

    def open_(args, device):
        opened.append(args)
        return buffers[args[1]]

    monkeypatch.setattr(cuda_ipc, "cuda_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(cuda_ipc, "export_handle", export)
    monkeypatch.setattr(cuda_ipc, "open_handle", open_)
    return opened


def join(sender, replicas, group="g"):
    """``ModelUpdateGroup.setup``'s calls, in this process; returns the replicas' agreed dtypes."""
    port = sender.mu_open(group, "cuda_ipc", HOST, TIMEOUT_S)
    sender.mu_join(group, len(replicas) + 1, TIMEOUT_S)
    for rank, r in enumerate(replicas):
        r.mu_join(group, "cuda_ipc", HOST, port, rank + 1, len(replicas) + 1, TIMEOUT_S)
    return agreed_dtypes([r.mu_dtypes() for r in replicas])


def push(sender, replicas, version, bucket_bytes, cast, group="g") -> dict:
    """``ModelUpdateGroup._collective``'s calls for a colocated backend: plan, check, write, read."""
    wire = sender.mu_plan(group, bucket_bytes, cast)
    for r in replicas:
        r.mu_check(group, wire)
    sent = sender.mu_send(group)
    for r in replicas:
        r.mu_receive(group, version, sent)
    return sent


def assert_bitwise_cast(replica_model, sender_model):
    """Every replica tensor is bf16 and holds the very bits of the sender's tensor cast to bf16."""
    want, got = sender_model.state_dict(), replica_model.state_dict()
    assert got.keys() == want.keys()
    for name, t in got.items():
        assert t.dtype == torch.bfloat16, name
        assert torch.equal(as_bytes(t.contiguous()), as_bytes(want[name].to(torch.bfloat16))), name


def test_push_into_bf16_replicas_is_the_senders_weights_cast_bitwise(handles):
    _, trainer = make_model(seed=1)  # fp32, tied embeddings
    replicas = [Replica(make_model(seed=seed)[1].to(torch.bfloat16)) for seed in (2, 3)]
    sender = Sender(trainer)
    cast = join(sender, replicas)
    assert set(cast.values()) == {"bfloat16"} and "lm_head.weight" in cast
    fp32_bytes = sum(t.numel() * 4 for names, t in unique_tensors(trainer.state_dict()))
    sent = push(sender, replicas, 1, bucket_bytes=4096, cast=cast)  # several buckets
    # packed once, in the replicas' dtype: half the fp32 bytes (+ alignment padding per bucket)
    assert fp32_bytes // 2 <= sent["bytes"] < fp32_bytes // 2 + 64 * len(trainer.state_dict())
    for r in replicas:
        assert_bitwise_cast(r.model, trainer)
        assert r.engine.version == 1
        assert r.model.lm_head.weight.data_ptr() == r.model.model.embed_tokens.weight.data_ptr()  # still tied
    assert len(handles) == 2  # each replica mapped the buffer once


def test_mapping_is_kept_across_pushes_and_renewed_when_the_buffer_grows(handles):
    _, trainer = make_model(seed=1)
    replica = Replica(make_model(seed=2)[1].to(torch.bfloat16))
    sender = Sender(trainer)
    cast = join(sender, [replica])
    first = push(sender, [replica], 1, 4096, cast)
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(-0.5)
    second = push(sender, [replica], 2, 4096, cast)
    assert second["handle"]["key"] == first["handle"]["key"] and len(handles) == 1  # the same mapping
    assert_bitwise_cast(replica.model, trainer)
    # a plan that needs more bytes (fp32 on the wire, no cast): a new buffer, mapped again
    third = push(sender, [replica], 3, 4096, cast={})
    assert third["bytes"] > second["bytes"] and third["handle"]["key"] != second["handle"]["key"]
    assert len(handles) == 2
    assert_bitwise_cast(replica.model, trainer)
    sender.mu_close("g")
    replica.mu_close("g")
    assert not hasattr(sender, "_mu_groups") or "g" not in sender._mu_groups


def test_receiver_drops_its_mapping_at_close(handles):
    receiver = cuda_ipc.IpcReceiver(torch.device("cpu"))
    sender = cuda_ipc.IpcSender(torch.device("cpu"))
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    metas = plan_state(state, 1 << 20)
    items = dict(receiver.read(sender.write(state, metas), metas))
    assert torch.equal(items["w"], state["w"]) and receiver.flat is not None
    receiver.close()
    sender.close()
    assert receiver.flat is None and receiver.key is None and sender.flat is None


def test_a_short_buffer_is_a_named_error(handles):
    state = {"w": torch.ones(64)}
    metas = plan_state(state, 1 << 20)
    with pytest.raises(ModelUpdateError, match="holds 16 bytes, the plan needs 256"):
        list(unpack_flat(torch.zeros(16, dtype=torch.uint8), metas))


def test_the_handle_is_rebuilt_on_the_receivers_own_device_index():
    args = tuple(range(15))  # rebuild_cuda_tensor's 15 arguments; the 7th is the storage's device
    assert cuda_ipc.on_device(args, 0) == (0, 1, 2, 3, 4, 5, 0, 7, 8, 9, 10, 11, 12, 13, 14)
    import inspect
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    params = list(inspect.signature(rebuild_cuda_tensor).parameters)
    assert params[cuda_ipc.DEVICE_ARG] == "storage_device" and len(params) == 15


def test_without_cuda_the_backend_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for make in (cuda_ipc.IpcSender, cuda_ipc.IpcReceiver):
        with pytest.raises(ModelUpdateError, match="cuda_ipc needs a GPU in every member"):
            make()
    sender = Sender(make_model(seed=1)[1])
    sender.mu_open("g", "cuda_ipc", HOST, TIMEOUT_S)
    with pytest.raises(ModelUpdateError, match="cuda_ipc needs a GPU"):
        sender.mu_join("g", 2, TIMEOUT_S)


def test_replicas_that_disagree_on_a_dtype_get_the_senders():
    assert agreed_dtypes([{"a": "bfloat16", "b": "float32"}, {"a": "bfloat16", "b": "bfloat16"}]) == {"a": "bfloat16"}
    assert agreed_dtypes([{"a": "bfloat16"}, {}]) == {}
    assert agreed_dtypes([]) == {}


def flat_views(sender, group="g") -> dict:
    """The sender's CUDA-IPC buffer read as the plan's tensors (what the replicas map)."""
    m = sender._mu_groups[group]
    return dict(unpack_flat(m.ipc.flat, m.metas))


def test_the_single_trainers_push_packs_its_live_weights_cast_in_the_copy(handles, monkeypatch):
    from flash.train.trainer import Trainer

    trainer = Trainer(make_model(seed=1)[1], settings())
    sender, replica = Sender(trainer.model), Replica(make_model(seed=2)[1].to(torch.bfloat16))
    cast = join(sender, [replica])
    copies = HostCopies(monkeypatch)
    copies.on = True
    wire = sender.mu_plan("g", 4096, cast)
    sent = sender.mu_send("g")
    copies.on = False
    assert copies.host == [] and copies.to == []  # no host copy, no cast copy beside the buffer
    live = {k: v for k, v in trainer.model.state_dict().items()}
    views = flat_views(sender)
    assert views.keys() == live.keys() and {v.dtype for v in views.values()} == {torch.bfloat16}
    assert all(torch.equal(as_bytes(views[k]), as_bytes(live[k].to(torch.bfloat16))) for k in live)
    bf16_bytes = sum(t.numel() * 2 for _, t in unique_tensors(live))
    assert bf16_bytes <= sent["bytes"] < bf16_bytes + 64 * len(wire)
    replica.mu_check("g", wire)
    replica.mu_receive("g", 1, sent)
    assert_bitwise_cast(replica.model, trainer.model)


@pytest.fixture
def fsdp_rank(tmp_path, one_torch_thread):
    """One FSDP2 rank (``FSDPRank``) of a one-rank gloo group in this process, the tiny model sharded."""
    import torch.distributed as dist

    from flash.train.fsdp import GroupSettings, free_port
    from flash.train.fsdp_rank import FSDPRank

    path = save_tiny(tmp_path / "tiny", TINY)
    rank = FSDPRank(0, 1, path, settings(), GroupSettings(), 0, 1, [], [])
    rank.setup(HOST, free_port())
    try:
        yield rank, path
    finally:
        dist.destroy_process_group()


def test_an_fsdp_ranks_cuda_ipc_push_gathers_the_engines_dtype_and_keeps_it_on_its_device(
    handles, monkeypatch, fsdp_rank
):
    from flash.cluster import load_model
    from flash.weights import gather
    from flash.weights.group import gathers_on_device

    rank, path = fsdp_rank
    with torch.no_grad():  # weights no fresh model holds
        for p in rank.trainer.model.parameters():
            p.add_(0.25)
    full = rank.full_state_dict()  # fp32, as get_weights reads it
    replica = Replica(load_model(path).to(torch.bfloat16))
    cast = join(rank, [replica])
    wired = []  # the bytes each gather moves
    real_gather = gather.dist.gather
    monkeypatch.setattr(gather.dist, "gather", lambda t, *a, **k: wired.append(t.dtype) or real_gather(t, *a, **k))
    copies = HostCopies(monkeypatch)
    copies.on = True
    rank.mu_gather(cast, gathers_on_device("cuda_ipc"))
    wire = rank.mu_plan("g", 4096, cast)
    sent = rank.mu_send("g")
    copies.on = False
    assert copies.host == [], copies.host  # no `.cpu()`, no copy to the host: device to device
    assert wired and set(wired) == {torch.bfloat16}  # cast on the rank's device before the gather
    assert {t.dtype for t in rank._mu_full.values()} == {torch.bfloat16}
    assert rank._mu_full["lm_head.weight"] is rank._mu_full["model.embed_tokens.weight"]  # tied: once
    bf16_bytes = sum(t.numel() * 2 for _, t in unique_tensors(rank._mu_full))  # the tied head once
    assert bf16_bytes <= sent["bytes"] < bf16_bytes + 64 * len(wire)
    replica.mu_check("g", wire)
    replica.mu_receive("g", 1, sent)
    got = replica.model.state_dict()
    assert all(torch.equal(as_bytes(got[k].contiguous()), as_bytes(full[k].to(torch.bfloat16))) for k in full)
    rank.mu_gather(cast, gathers_on_device("nccl"))  # another backend: host memory, still bf16
    assert {t.dtype for t in rank._mu_full.values()} == {torch.bfloat16}
    assert gathers_on_device("cuda_ipc") and not any(map(gathers_on_device, ("nccl", "gloo", "shm")))
