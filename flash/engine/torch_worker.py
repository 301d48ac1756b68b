"""The torch rollout engine as a Ray actor (``EngineWorker``) and ``start_engine``, which starts
it or the vLLM engine behind the same methods (the protocols of ``flash.engine.base``).

The actor owns its torch thread count, so that a synchronous run lets every phase use all the
cores (the phases alternate) while an asynchronous run splits them between roles that overlap.
It is threaded (``max_concurrency``): the scheduler's blocking ``get_finished`` and the
controller's ``pause`` must not queue behind each other.
"""

from __future__ import annotations

import os
import threading

import ray
import torch

from flash.cluster import load_model
from flash.engine.base import GenerationOutput, GenerationRequest, check_request, error_output
from flash.usage import process_tree_cpu_s
from flash.weights.group import UpdateReceiver
from flash.weights.model_update import unique_tensors


class EngineWorker(UpdateReceiver):
    def __init__(self, model_path: str, max_num_seqs: int, seed: int, threads: int):
        from flash.engine.loop import EngineLoop
        from flash.engine.torch_engine import TorchEngine
        from flash.placement import visible_devices

        torch.set_num_threads(max(1, threads))
        model = load_model(model_path).eval()
        if visible_devices() and torch.cuda.is_available():  # placed on a device (flash.placement)
            model = model.to("cuda")
        text = model.config.get_text_config(decoder=True)
        self.vocab_size, self.max_context = text.vocab_size, text.max_position_embeddings
        self._shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}  # model-update check
        self._ties = [names for names, _ in unique_tensors(model.state_dict()) if len(names) > 1]
        self._model = model  # the model-update group receives large tensors straight into it
        self.loop = EngineLoop(TorchEngine(model, max_num_seqs=max_num_seqs, seed=seed))
        self._refused: list = []  # outputs of requests check_request refused, not yet taken
        self._refused_lock = threading.Lock()  # submit and get_finished run on different threads

    def submit(self, requests: list[GenerationRequest]) -> int:
        """Queue ``requests``; one that cannot be served finishes at once with an error output."""
        ok = []
        for r in requests:
            why = check_request(r, vocab_size=self.vocab_size, max_context=self.max_context)
            if why is None:
                ok.append(r)
            else:
                with self._refused_lock:
                    self._refused.append(error_output(r, why))
        if ok:
            self.loop.submit(ok)
        return len(requests)

    def get_finished(self, timeout: float) -> list[GenerationOutput]:
        with self._refused_lock:
            refused, self._refused = self._refused, []
        if refused:
            return refused + self.loop.get_finished(timeout=0)
        return self.loop.get_finished(timeout=timeout)

    def pause(self, mode: str) -> None:
        self.loop.pause(mode)

    def resume(self) -> None:
        self.loop.resume()

    def update_weights(self, named_tensors, version: int) -> float:
        """Load the pushed weights; returns the bytes received (the model-update size metric)."""
        self.loop.update_weights(named_tensors, version)
        tensors = named_tensors.values() if hasattr(named_tensors, "values") else (t for _, t in named_tensors)
        return float(sum(t.numel() * t.element_size() for t in tensors))

    def get_weights(self) -> dict:
        """The weights this replica serves (CPU copies): what a check against the trainer compares.
        Outside the contract: vLLM's weights live in its child process, so only tests ask the torch
        engine."""
        return {k: v.detach().cpu().clone() for k, v in self._model.state_dict().items()}

    def sleep(self, level: int = 1) -> dict:
        """Release memory for a colocated trainer while paused; see ``TorchEngine.sleep``."""
        return self.loop.sleep(level)

    def wake_up(self) -> dict:
        return self.loop.wake_up()

    def _mu_shapes(self) -> dict:
        return self._shapes

    def _mu_ties(self) -> list:
        return self._ties

    def _mu_targets(self) -> dict:
        """Written only while ``_mu_apply`` iterates, i.e. inside the paused loop's update."""
        return self._model.state_dict()

    def _mu_apply(self, items, version: int) -> None:
        """Model-update group: copy each pushed tensor into the live model as it arrives."""
        self.loop.update_weights(items, version)

    def abort(self, request_ids: list[str] | None = None) -> list[GenerationOutput]:
        return self.loop.abort(request_ids)

    def stats(self) -> dict:
        return {**self.loop.stats(), "cpu_s": process_tree_cpu_s()}

    def version(self) -> int:
        return int(self.loop.stats()["version"])

    def health(self) -> bool:
        """True, or raises: the engine loop's thread died or was shut down."""
        self.loop.stats()
        return True

    def busy_spans(self) -> list[list[float]]:
        return self.loop.busy_spans()

    def pid(self) -> int:
        """The actor's process id (fault-injection tests and benchmarks kill it)."""
        return os.getpid()

    def shutdown(self) -> None:
        self.loop.shutdown()


ENGINES = ("torch", "vllm")


def start_engine(model_path: str, max_num_seqs: int, seed: int, threads: int, engine: str = "torch",
                 options: dict | None = None, sleep_mode: bool = False, max_restarts: int = 0):
    """The engine actor: ``torch`` (embedded, ``EngineWorker``) or ``vllm`` (``VLLMEngineWorker``).

    Both satisfy the protocols of ``flash.engine.base``, so the controller and the scheduler never
    know which one runs.
    ``options``: extra actor options, e.g. ``Placement.options`` (devices, placement group).
    ``sleep_mode``: the engine shares its devices and must be able to release memory (vLLM
    reserves its sleep allocator at start; the torch engine always can).
    ``max_restarts``: Ray re-creates a dead engine this many times (flash.engine.client recovers its work).
    """
    if engine == "vllm":
        from flash.engine.vllm_engine import VLLMEngineWorker

        cls = VLLMEngineWorker
    elif engine == "torch":
        cls = EngineWorker
    else:
        raise ValueError(f"unknown rollout engine {engine!r}; expected one of {ENGINES}")
    actor = ray.remote(cls).options(num_cpus=0, max_concurrency=8, max_restarts=max_restarts,
                                    **(options or {}))
    kwargs = {"sleep_mode": True} if sleep_mode and engine == "vllm" else {}
    return actor.remote(model_path, max_num_seqs, seed, threads, **kwargs)
