"""Every model-update member says where its weights live, and each GPU recipe's layout gets the
backend its header promises: ``nccl`` for gsm8k_8gpu (four FSDP2 ranks, four vLLM replicas on
their own GPUs), ``cuda_ipc`` for gsm8k_1gpu (trainer and torch engine on one GPU).

No Ray and no CUDA: each member's process is simulated as the placement makes it (Ray gives a
one-device worker the GPU of its first device's bundle, visible to it as ``cuda:0``), and the
member's own ``mu_where`` reports from there.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray
import torch

from flash.app.config import load_config
from flash.app.recipe_files import recipe_paths
from flash.engine.torch_worker import ENGINES, engine_class
from flash.placement import plan_placement
from flash.train.fsdp import pick_device
from flash.train.fsdp_rank import FSDPRank
from flash.weights.group import UpdateReceiver, choose_backend
from tests.helpers.standins import gpu_recipe_overrides

NODE = "node-0"


@pytest.fixture
def on_gpu(monkeypatch):
    """``on_gpu(i)``: make this process look like a Ray actor given physical GPU ``i``."""

    def place(gpu: int) -> None:
        monkeypatch.setattr(ray, "is_initialized", lambda: True)
        monkeypatch.setattr(ray, "get_gpu_ids", lambda: [str(gpu)])
        monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: NODE))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid=f"GPU-{gpu}"))

    return place


def engine_where(engine: str, gpu: int, on_gpu) -> dict:
    """What an engine replica of ``engine`` placed on ``gpu`` reports, its weights where its
    constructor puts them (the torch engine: ``actor_device()``, recorded; vLLM and the simulator
    hold nothing to record)."""
    on_gpu(gpu)
    worker = engine_class(engine).__new__(engine_class(engine))
    if engine == "torch":
        from flash.devices import actor_device

        worker._device = actor_device()
    return worker.mu_where()


def trainer_where(gpu: int, on_gpu) -> dict:
    """What an FSDP2 rank placed on ``gpu`` reports (its device as its constructor picks it)."""
    on_gpu(gpu)
    rank = FSDPRank.__new__(FSDPRank)
    rank.device, _ = pick_device()
    return rank.mu_where()


WHERE_ON_GPU_5 = {"torch": "cuda:GPU-5", "vllm": "cuda:GPU-5", "sim": "cpu"}  # the simulator's weight: a host tensor


@pytest.mark.parametrize("engine", ENGINES)
def test_every_engine_class_says_where_its_weights_live(engine, on_gpu):
    assert engine_class(engine)._mu_device is not UpdateReceiver._mu_device, engine
    with pytest.raises(NotImplementedError, match="must say where its weights live"):
        type("Bare", (UpdateReceiver,), {})().mu_where()
    assert engine_where(engine, 5, on_gpu) == {"node": NODE, "device": WHERE_ON_GPU_5[engine]}


@pytest.mark.parametrize("recipe, backend", [("gsm8k_8gpu", "nccl"), ("gsm8k_1gpu", "cuda_ipc")])
def test_each_gpu_recipe_layout_gets_its_backend(recipe, backend, tmp_path, on_gpu):
    cfg = load_config(recipe_paths()[recipe], gpu_recipe_overrides(tmp_path, recipe))
    plan = plan_placement(cfg.placement, cfg.rollout.engine)
    sender = trainer_where(plan.workers["actor_train"][0].devices[0], on_gpu)  # rank 0 pushes
    replicas = [engine_where(cfg.rollout.engine, w.devices[0], on_gpu) for w in plan.workers["actor_infer"]]
    assert all(r["device"].startswith("cuda:") for r in replicas)
    assert choose_backend(cfg.model_update.backend, [sender, *replicas]) == backend
    assert choose_backend("auto", [sender, *replicas]) == backend


def test_a_tensor_parallel_replica_takes_one_group_rank_per_vllm_worker():
    from flash.engine.vllm_engine import VLLMEngineWorker
    from flash.weights.group import member_ranks

    assert member_ranks([1, 1, 1, 1]) == ([1, 2, 3, 4], 5)  # gsm8k_8gpu: the trainer and four replicas
    assert member_ranks([2, 2]) == ([1, 3], 5) and member_ranks([4, 1]) == ([1, 5], 6)
    assert UpdateReceiver.mu_members(SimpleNamespace()) == 1
    assert VLLMEngineWorker.mu_members(SimpleNamespace(_tp=2)) == 2


def test_each_vllm_worker_joins_at_its_replicas_first_rank_plus_its_tensor_parallel_rank(monkeypatch):
    from flash.engine.vllm_weights import WeightSync

    joined = []
    monkeypatch.setattr(UpdateReceiver, "mu_join", lambda self, *args: joined.append(args[4]))
    for tp_rank in (0, 1):
        worker = object.__new__(WeightSync)
        worker.rank = tp_rank  # vLLM's worker's rank in its tensor-parallel world
        worker.mu_join("g", "nccl", "127.0.0.1", 1234, 3, 5, 10.0)
    assert joined == [3, 4]
