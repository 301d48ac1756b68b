"""Checkpoint snapshots in host memory (``flash.staging``): pinned buffers for a CUDA device, the
buffers reused by the next snapshot, host tensors cloned (a clone's checkpoint bytes)."""

from __future__ import annotations

import copy
import io

import torch

from flash import checkpoint as ck
from flash.staging import HostStager, staging_kwargs
from tests.helpers.checkpointing import small_batch, small_trainer


def test_a_cuda_tensor_is_staged_to_pinned_host_memory_and_a_host_tensor_to_plain():
    assert staging_kwargs("cuda:0") == {"device": "cpu", "pin_memory": True}
    assert staging_kwargs(torch.device("cuda", 3)) == {"device": "cpu", "pin_memory": True}
    assert staging_kwargs("cpu") == {"device": "cpu"}
    assert staging_kwargs("meta") == {"device": "cpu"}


def test_a_device_tensors_snapshot_lives_on_the_host_equals_it_and_reuses_its_buffer():
    stager = HostStager(host_kinds=())  # every tensor goes through the staging buffers
    live = {"w": torch.arange(6.0).reshape(2, 3).t(), "opt": [{"m": torch.ones(4)}, 7], "step": torch.tensor(2.0)}
    first = stager.stage(live)
    assert first["w"].device.type == "cpu" and torch.equal(first["w"], live["w"]) and first["opt"][1] == 7
    assert first["w"].untyped_storage().data_ptr() != live["w"].untyped_storage().data_ptr()
    live["w"].mul_(10)  # training goes on: the snapshot does not move
    assert torch.equal(first["w"], torch.arange(6.0).reshape(2, 3).t())
    second = stager.stage(live)
    assert second["w"] is first["w"] and second["opt"][0]["m"] is first["opt"][0]["m"]  # buffers reused
    assert torch.equal(second["w"], torch.arange(0.0, 60.0, 10.0).reshape(2, 3).t())
    live["opt"][0]["m"] = torch.zeros(5)  # another shape: a new buffer
    assert stager.stage(live)["opt"][0]["m"].shape == (5,)


def test_host_tensors_are_cloned_fresh_each_snapshot():
    stager, t = HostStager(), torch.ones(3)
    a, b = stager.stage({"t": t})["t"], stager.stage({"t": t})["t"]
    assert a is not b and a.data_ptr() != t.data_ptr() and torch.equal(a, t)


def test_a_cpu_trainers_checkpoint_bytes_are_the_clone_and_deepcopy_ones():
    tr = small_trainer()
    tr.train_step(*small_batch(1), None)
    old = {
        "model": {k: v.detach().clone() for k, v in tr.model.state_dict().items()},
        "optimizer": copy.deepcopy(tr.optimizer.state_dict()),
    }
    new = ck.trainer_state(tr)

    def saved(obj) -> bytes:
        f = io.BytesIO()
        torch.save(obj, f)
        return f.getvalue()

    assert saved({"model": new["model"], "optimizer": new["optimizer"]}) == saved(old)


def test_an_fsdp_shard_stays_a_dtensor_whose_local_tensor_is_the_reused_host_buffer():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        live = distribute_tensor(torch.arange(12.0).reshape(3, 4), init_device_mesh("cpu", (1,)), [Shard(0)])
        stager = HostStager(host_kinds=())
        first = stager.stage({"w": live})["w"]
        assert isinstance(first, DTensor) and first.placements == (Shard(0),)
        assert (
            torch.equal(first.to_local(), live.to_local()) and first.to_local().data_ptr() != live.to_local().data_ptr()
        )
        live.to_local().add_(1.0)
        second = stager.stage({"w": live})["w"]
        assert second is first and torch.equal(second.to_local(), torch.arange(1.0, 13.0).reshape(3, 4))
    finally:
        dist.destroy_process_group()
