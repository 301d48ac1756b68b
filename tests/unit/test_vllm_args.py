"""vLLM's arguments per device (``flash.engine.vllm_parts``): CUDA graphs, chunked prefill, no
per-request seeds and one tensor-parallel rank per device on CUDA; eager, whole-prefill, seeded
settings on the CPU; and what the engine worker and the roles pass on."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch

from flash.app.config import load_config
from flash.app.recipe_files import recipe_paths
from flash.app.roles import engine_kwargs
from flash.engine import vllm_engine
from flash.engine.base import GenerationRequest, SamplingParams
from flash.engine.vllm_parts import device_args, request_seeds
from flash.placement import plan_placement
from tests.helpers.standins import gpu_recipe_overrides, model_folder

CPU_ARGS = {"enforce_eager": True, "enable_chunked_prefill": False, "max_num_batched_tokens": 4096}


def test_cuda_gets_graphs_chunked_prefill_and_tensor_parallel_ranks_the_cpu_eager_whole_prefills():
    assert device_args("cuda", 4096, 256) == {
        "enforce_eager": False,
        "enable_chunked_prefill": True,
        "max_num_batched_tokens": 8192,
        "tensor_parallel_size": 1,
    }
    assert device_args("cuda", 4096, 16384, 2) == {
        "enforce_eager": False,
        "enable_chunked_prefill": True,
        "max_num_batched_tokens": 16384,
        "tensor_parallel_size": 2,
        "distributed_executor_backend": "mp",
    }
    assert device_args("cpu", 4096, 256) == CPU_ARGS
    assert device_args("cpu", 4096, 256, 2) == CPU_ARGS  # a CPU engine (simulated GPUs) runs one rank
    assert device_args("cpu", 512, 8)["max_num_batched_tokens"] == 2048


def test_requests_carry_their_own_seed_on_the_cpu_or_when_asked():
    assert request_seeds("cpu", None) is True and request_seeds("cuda", None) is False
    assert request_seeds("cuda", True) is True and request_seeds("cpu", False) is False


def _worker(monkeypatch, tmp_path, kind: str, **kwargs):
    """A VLLMEngineWorker on ``kind`` over a stand-in AsyncLLM that records what it is given."""
    seen: dict = {"params": []}

    async def generate(prompt, params, request_id):
        seen["params"].append(params)
        return
        yield  # an async generator that finishes at once

    async def start(args):
        seen["args"] = args
        return SimpleNamespace(errored=False, generate=generate, shutdown=lambda: None)

    monkeypatch.setattr(vllm_engine.VLLMEngineWorker, "_start", staticmethod(start))
    monkeypatch.setattr(vllm_engine, "actor_device", lambda: torch.device(kind))
    worker = vllm_engine.VLLMEngineWorker(str(model_folder(tmp_path, "Qwen2.5-0.5B-Instruct")), 8, 0, 1, **kwargs)
    req = GenerationRequest("r0", [3, 4, 5], SamplingParams(max_new_tokens=4, seed=11))

    async def launch():
        await worker._submit([req])
        await asyncio.gather(*(r.task for r in list(worker._reqs.values())))

    worker._call(launch())
    worker.shutdown()
    return seen


def test_the_cuda_worker_starts_vllm_with_graphs_and_samples_without_request_seeds(monkeypatch, tmp_path):
    seen = _worker(monkeypatch, tmp_path, "cuda", tensor_parallel_size=2)
    assert {k: seen["args"][k] for k in ("enforce_eager", "enable_chunked_prefill", "tensor_parallel_size")} == {
        "enforce_eager": False,
        "enable_chunked_prefill": True,
        "tensor_parallel_size": 2,
    }
    assert seen["args"]["seed"] == 0 and seen["params"][0].seed is None


def test_the_cpu_worker_keeps_eager_whole_prefills_and_the_requests_seed(monkeypatch, tmp_path):
    seen = _worker(monkeypatch, tmp_path, "cpu", tensor_parallel_size=2)
    assert {k: seen["args"][k] for k in CPU_ARGS} == {**CPU_ARGS, "max_num_batched_tokens": 2048}
    assert "tensor_parallel_size" not in seen["args"] and seen["params"][0].seed == 11
    asked = _worker(monkeypatch, tmp_path / "asked", "cuda", request_seeds=True)
    assert asked["params"][0].seed == 11


def test_each_vllm_worker_gets_its_device_count_as_tensor_parallel_size(tmp_path):
    cfg = load_config(
        recipe_paths()["gsm8k_8gpu"],
        gpu_recipe_overrides(tmp_path, "gsm8k_8gpu") + ["placement.roles.actor_infer.num_workers=2"],
    )
    plan = plan_placement(cfg.placement, cfg.rollout.engine)
    assert engine_kwargs(cfg, plan, 1, False) == {"dtype": "bfloat16", "tensor_parallel_size": 2, "request_seeds": None}
    cfg.placement.roles.actor_infer.num_workers = 4  # the recipe's own layout: one GPU each
    assert engine_kwargs(cfg, plan_placement(cfg.placement, "vllm"), 3, False)["tensor_parallel_size"] == 1
