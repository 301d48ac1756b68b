"""The vLLM engine's parts that hold no engine state: a request's bookkeeping (``Req``), how vLLM's
finish reasons map onto flash's, and the settings vLLM is started with (``memory_args``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from flash.devices import colocated_engine_fraction
from flash.engine.base import GenerationOutput, GenerationRequest

FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


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
        return GenerationOutput(r.request_id, list(r.prompt_ids), list(self.tokens), list(self.logprobs),
                                list(self.versions), reason, error)


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
