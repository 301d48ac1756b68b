"""Colocated memory is really handed back, in an order that fits on one GPU: a sleeping engine
releases its KV cache and weights and then the allocator's cached blocks; a train step ends with
its gradients dropped and the cached blocks released; colocated engines sleep at level 2 (the push
overwrites every weight); vLLM wakes its weights for the push and its KV cache only at resume;
a colocated vLLM takes the share of the card the trainer leaves, not its default 0.9.

No CUDA here: a stand-in allocator records each ``torch.cuda.empty_cache`` call and what was
still allocated when it came (``release_cached_memory`` itself is the one place that calls it).
"""

from __future__ import annotations

import asyncio
import copy
from types import SimpleNamespace

import pytest
import torch

from flash import devices
from flash.devices import colocated_engine_fraction, release_cached_memory
from flash.engine.base import GenerationRequest, SamplingParams
from flash.engine.torch_engine import TorchEngine
from flash.engine.vllm_engine import VLLMEngineWorker
from flash.engine.vllm_parts import memory_args
from flash.train.batch import collate
from flash.train.trainer import Trainer
from tests.helpers.models import PROMPTS, make_model
from tests.helpers.train import toy_model, toy_samples, toy_settings

GIB = 2**30


@pytest.fixture
def allocator(monkeypatch):
    """A stand-in CUDA allocator: ``events`` gets ``("empty_cache", what())`` per call, ``what``
    being set by the test to describe what is still allocated at that moment."""
    state = SimpleNamespace(events=[], what=lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: state.events.append(("empty_cache", state.what())))
    return state


def test_release_cached_memory_empties_the_cuda_cache_only(allocator):
    assert release_cached_memory(torch.device("cuda", 0)) is True
    assert release_cached_memory(torch.device("cpu")) is False and release_cached_memory(None) is False
    assert allocator.events == [("empty_cache", None)]


def on_cuda(monkeypatch, module) -> None:
    """``module``'s ``release_cached_memory`` sees its CPU device as the GPU it would be."""
    monkeypatch.setattr(
        module, "release_cached_memory", lambda device: devices.release_cached_memory(torch.device("cuda", 0))
    )


def test_a_sleeping_engine_releases_the_cache_after_its_weights_and_kv(monkeypatch, allocator):
    import flash.engine.torch_engine as torch_engine

    on_cuda(monkeypatch, torch_engine)
    _, model = make_model(seed=1)
    engine = TorchEngine(model, max_num_seqs=2)
    engine.add_request(GenerationRequest("r0", PROMPTS[0], SamplingParams(max_new_tokens=8, temperature=0.0)))
    engine.step()  # a running batch: its KV cache allocated
    assert engine._kv is not None
    allocator.what = lambda: (engine._kv, model.lm_head.weight.numel())
    engine.preempt("continue")
    info = engine.sleep(2)
    assert allocator.events == [("empty_cache", (None, 0))]  # KV dropped and weights discarded first
    assert info["cache_released"] is True and info["kv_bytes_released"] > 0
    engine.wake_up()
    assert engine._kv is None  # weights back for the push; the KV cache waits for the first step


def test_a_train_step_ends_with_the_cache_released_after_the_optimizer_step(monkeypatch, allocator):
    import flash.train.trainer as trainer_module

    on_cuda(monkeypatch, trainer_module)
    tr = Trainer(copy.deepcopy(toy_model()), toy_settings(micro_batch_size=4))
    n_params = len(list(tr.model.parameters()))
    allocator.what = lambda: len(tr.optimizer.state)  # AdamW's state exists once it stepped
    batch = collate(toy_samples(n=8))
    adv = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(3)) * batch.mask
    tr.train_step(batch, adv, None)  # 4 micro-batches, one optimizer step: one release, at its end
    assert allocator.events == [("empty_cache", n_params)]


def test_colocated_engines_sleep_at_level_2_before_the_trainer():
    from flash.controllers.async_controller import AsyncController

    calls = []
    ctl = AsyncController.__new__(AsyncController)
    ctl.s = SimpleNamespace(interrupt="continue")
    ctl.phase = lambda name: __import__("contextlib").nullcontext()
    ctl._engine_get = lambda name, *args: calls.append((name, *args))
    ctl._free_devices()
    assert calls == [("pause", "continue"), ("sleep", 2)]


class StandInLLM:
    """vLLM's ``AsyncLLM`` as far as sleep and wake-up go, recording the calls."""

    def __init__(self):
        self.calls = []
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=True))

    async def sleep(self, level):
        self.calls.append(("sleep", level))

    async def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))


def test_vllm_wakes_its_weights_for_the_push_and_its_kv_cache_at_resume():
    worker = VLLMEngineWorker.__new__(VLLMEngineWorker)
    worker._llm, worker._paused, worker._asleep, worker._kv_asleep, worker._held = (
        StandInLLM(),
        "continue",
        None,
        False,
        [],
    )

    async def cycle():
        worker._drained = asyncio.Condition()
        await worker._sleep(2)
        await worker._wake_up()
        worker._llm.calls.append(("push",))  # update_weights runs here, on the woken weights
        await worker._resume()

    asyncio.run(cycle())
    assert worker._llm.calls == [("sleep", 2), ("wake_up", ["weights"]), ("push",), ("wake_up", ["kv_cache"])]


def test_a_colocated_engine_takes_what_the_trainer_leaves():
    # gsm8k_1gpu's model (0.49 B params) on an 80 GiB card: 16 B/param resident (7.4 GiB), 2 GiB headroom
    assert colocated_engine_fraction(80 * GIB, 0.494e9 * 16) == 0.882
    assert colocated_engine_fraction(24 * GIB, 0.494e9 * 16) == 0.609  # on a 24 GiB card
    assert colocated_engine_fraction(80 * GIB, 1e9) == 0.9  # capped at vLLM's default
    # Qwen2.5-7B (7.6 B params) on one 80 GiB card, trainer unsharded: 113 GiB resident, no room
    with pytest.raises(ValueError, match="give actor_infer its own devices, or more trainer ranks"):
        colocated_engine_fraction(80 * GIB, 7.6e9 * 16)
    # the same model over 4 colocated FSDP2 ranks on 80 GiB cards: 28.3 GiB a rank
    assert colocated_engine_fraction(80 * GIB, 7.6e9 * 16 / 4) == 0.621


def test_vllm_memory_args_follow_the_card(monkeypatch):
    assert memory_args(10**9, None) == {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 * GIB))
    # 7.6 B params, 16 B/param over 4 ranks: (80 - 28.31 - 2) / 80 = 0.621...
    assert memory_args(7_600_000_000, 4.0) == {"gpu_memory_utilization": 0.621}


def test_the_trainer_budget_of_gsm8k_8gpu_colocated_on_its_four_trainer_gpus(tmp_path):
    from flash.app.config import load_config
    from flash.app.recipe_files import recipe_paths
    from flash.app.roles import colocated_trainer_bytes_per_param
    from flash.placement import plan_placement
    from tests.helpers.standins import gpu_recipe_overrides

    overrides = ["placement.num_gpus=4", "placement.roles.actor_infer.device_mapping=[0,1,2,3]"]
    cfg = load_config(recipe_paths()["gsm8k_8gpu"], gpu_recipe_overrides(tmp_path, "gsm8k_8gpu") + overrides)
    plan = plan_placement(cfg.placement, cfg.rollout.engine)
    assert plan.colocated("actor_train", "actor_infer")
    assert colocated_trainer_bytes_per_param(cfg, plan) == 16 / 4  # no KL penalty: no local reference
    kl = load_config(
        recipe_paths()["gsm8k_8gpu"],
        gpu_recipe_overrides(tmp_path, "gsm8k_8gpu") + overrides + ["algo.loss.kl_coef=0.01"],
    )
    assert colocated_trainer_bytes_per_param(kl, plan) == 20 / 4
