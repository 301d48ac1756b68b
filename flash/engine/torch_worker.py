"""The torch rollout engine as a Ray actor (``EngineWorker``) and ``start_engine``, which starts
it or the vLLM engine behind the same methods (the protocols of ``flash.engine.base``).

The actor owns its torch thread count, so that a synchronous run lets every phase use all the
cores (the phases alternate) while an asynchronous run splits them between roles that overlap.
Its model lives on the device Ray gave it (``flash.devices.actor_device``), in ``model.dtype``;
pushed weights are cast to that dtype as they are copied in.
It is threaded (``max_concurrency``): the scheduler's blocking ``get_finished`` and the
controller's ``pause`` must not queue behind each other.
"""

from __future__ import annotations

from typing import get_args

import ray
import torch

from flash.cluster import load_model
from flash.engine.base import EngineKind
from flash.devices import actor_device, torch_dtype
from flash.engine.loop_actor import LoopActor
from flash.weights.group import UpdateReceiver
from flash.weights.model_update import unique_tensors


class EngineWorker(LoopActor, UpdateReceiver):
    def __init__(
        self,
        model_path: str,
        max_num_seqs: int,
        seed: int,
        threads: int,
        dtype: str = "float32",
        max_num_batched_tokens: int = 0,
    ):
        from flash.engine.torch_engine import TorchEngine

        torch.set_num_threads(max(1, threads))
        self._device = actor_device()  # where the weights live awake (a level-1 sleep moves them to the host)
        model = load_model(model_path).to(self._device, torch_dtype(dtype)).eval()
        text = model.config.get_text_config(decoder=True)
        self._shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}  # model-update check
        self._ties = [names for names, _ in unique_tensors(model.state_dict()) if len(names) > 1]
        self._model = model  # the model-update group receives large tensors straight into it
        self._start_loop(
            TorchEngine(model, max_num_seqs=max_num_seqs, seed=seed, max_num_batched_tokens=max_num_batched_tokens),
            text.vocab_size,
            text.max_position_embeddings,
        )

    def get_weights(self) -> dict:
        """The weights this replica serves (CPU copies): what a check against the trainer compares.
        Outside the contract: vLLM's weights live in its child process, so only tests ask the torch
        engine."""
        return {k: v.detach().cpu().clone() for k, v in self._model.state_dict().items()}

    def _mu_device(self) -> torch.device:
        """Where the weights live: the backend choice compares it with the trainer's. The device
        the model was placed on, not its parameters' now: asleep at level 1 they are on the host."""
        return self._device

    def _mu_shapes(self) -> dict:
        return self._shapes

    def _mu_ties(self) -> list:
        return self._ties

    def _mu_targets(self) -> dict:
        """Written only while ``_mu_apply`` iterates, i.e. inside the paused loop's update."""
        return self._model.state_dict()


ENGINES: tuple[str, ...] = get_args(EngineKind)


def engine_class(engine: str):
    """The actor class of ``rollout.engine`` (vLLM's and the simulator's modules load on demand)."""
    if engine == "vllm":
        from flash.engine.vllm_engine import VLLMEngineWorker

        return VLLMEngineWorker
    if engine == "sim":
        from flash.engine.sim_engine import SimEngineWorker

        return SimEngineWorker
    if engine == "torch":
        return EngineWorker
    raise ValueError(f"unknown rollout engine {engine!r}; expected one of {ENGINES}")


def start_engine(
    model_path: str,
    max_num_seqs: int,
    seed: int,
    threads: int,
    engine: str = "torch",
    options: dict | None = None,
    sleep_mode: bool = False,
    max_restarts: int = 0,
    engine_kwargs: dict | None = None,
):
    """The engine actor: ``torch`` (embedded, ``EngineWorker``), ``vllm`` (``VLLMEngineWorker``) or
    ``sim`` (``flash.engine.sim_engine.SimEngineWorker``: GPU time from a cost model).

    All satisfy the protocols of ``flash.engine.base``, so the controller and the scheduler never
    know which one runs.
    ``options``: extra actor options, e.g. ``Placement.options`` (devices, placement group).
    ``sleep_mode``: the engine shares its devices and must be able to release memory (vLLM
    reserves its sleep allocator at start; the torch engine always can).
    ``max_restarts``: Ray re-creates a dead engine this many times (flash.engine.client recovers its work).
    ``engine_kwargs``: further arguments of the engine's constructor (``dtype`` for torch and vLLM,
    the simulator's settings).
    """
    cls = engine_class(engine)
    actor = ray.remote(cls).options(num_cpus=0, max_concurrency=8, max_restarts=max_restarts, **(options or {}))
    kwargs = {"sleep_mode": True} if sleep_mode and engine == "vllm" else {}
    return actor.remote(model_path, max_num_seqs, seed, threads, **kwargs, **(engine_kwargs or {}))
