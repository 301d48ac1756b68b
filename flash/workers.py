"""Ray actors for the two compute roles: the rollout engine and the trainer.

Each actor owns its torch thread count, so that a synchronous run lets every phase use all the
cores (the phases alternate) while an asynchronous run splits them between roles that overlap.
The engine actor is threaded (``max_concurrency``): the scheduler's blocking ``get_finished`` and
the controller's ``pause`` must not queue behind each other.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ray
import torch

from flash.model_update import unique_tensors
from flash.model_update_group import UpdateReceiver, UpdateSender
from flash.usage import process_tree_cpu_s

QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
             "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", "TOKENIZERS_PARALLELISM": "false"}
# OpenMP threads that spin while waiting for a busy core collapse throughput (measured: 2-thread
# decode fell from ~5k to ~0.2-1k tokens/s on a loaded 2-core machine); passive waiting costs
# little on an idle one. Roles that alternate (sync) or overlap (async) both need it.
PERF_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def quiet() -> None:
    """No per-process download/loading progress bars or advisory warnings in the run's output."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_model(path: str):
    from transformers import AutoModelForCausalLM

    quiet()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model


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

    def submit(self, requests) -> int:
        """Queue ``requests``; one that cannot be served finishes at once with an error output."""
        from flash.engine.base import check_request, error_output

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

    def get_finished(self, timeout: float):
        with self._refused_lock:
            refused, self._refused = self._refused, []
        if refused:
            return refused + self.loop.get_finished(timeout=0)
        return self.loop.get_finished(timeout=timeout)

    def pause(self, mode: str) -> None:
        self.loop.pause(mode)

    def resume(self) -> None:
        self.loop.resume()

    def update_weights(self, named_tensors: dict, version: int) -> float:
        """Load the pushed weights; returns the bytes received (the model-update size metric)."""
        self.loop.update_weights(named_tensors, version)
        tensors = named_tensors.values() if hasattr(named_tensors, "values") else (t for _, t in named_tensors)
        return float(sum(t.numel() * t.element_size() for t in tensors))

    def get_weights(self) -> dict:
        """The weights this replica serves (CPU copies): what a check against the trainer compares."""
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

    def abort(self, request_ids=None):
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


def plugin_paths(modules: list[str]) -> list[str]:
    """Directories the driver imports ``modules`` from, so a worker process can import them too."""
    import importlib.util

    paths = []
    for name in modules:
        spec = importlib.util.find_spec(name.split(".")[0])
        if spec is not None and spec.origin:
            root = Path(spec.origin).parent
            paths.append(str(root.parent if spec.submodule_search_locations else root))
    return paths


class TrainerWorker(UpdateSender):
    def __init__(self, model_path: str, settings, seed: int, threads: int, plugins: list[str],
                 paths: list[str] = ()):
        import algos
        from flash.trainer import Trainer

        torch.set_num_threads(max(1, threads))
        sys.path[:0] = [p for p in paths if p not in sys.path]
        algos.load_plugins(list(plugins))
        self.trainer = Trainer(load_model(model_path), settings, seed=seed)
        self._lock = threading.Lock()  # a checkpoint snapshot never sees half a step
        self._snapshot: dict | None = None

    def logprobs(self, batch):
        return self.trainer.logprobs(batch)

    def train_step(self, batch, advantages, prox_logp) -> dict:
        with self._lock:
            return self.trainer.train_step(batch, advantages, prox_logp)

    # Checkpoint hooks (flash.checkpoint): a copy taken between steps, written while training goes
    # on. An FSDP2 trainer replaces the three functions with torch.distributed.checkpoint.
    def checkpoint_snapshot(self) -> None:
        from flash.checkpoint import trainer_state

        with self._lock:
            self._snapshot = trainer_state(self.trainer)

    def checkpoint_write(self, directory: str) -> None:
        from flash.checkpoint import save_trainer_state

        snapshot, self._snapshot = self._snapshot, None
        if snapshot is None:
            raise RuntimeError("checkpoint_write without a checkpoint_snapshot first")
        save_trainer_state(snapshot, directory)

    def load_checkpoint(self, directory: str) -> int:
        from flash.checkpoint import load_trainer_state

        with self._lock:
            return load_trainer_state(self.trainer, directory)

    def begin_step(self) -> None:
        self.trainer.begin_step()

    def accumulate(self, batch, advantages, prox_logp) -> float:
        return self.trainer.accumulate(batch, advantages, prox_logp)

    def finish_step(self) -> dict:
        with self._lock:
            return self.trainer.finish_step()

    def get_weights(self) -> dict:
        with self._lock:  # never half a step (a restarted engine may ask during one: flash.faults)
            return self.trainer.state_dict()

    def _mu_state(self) -> dict:
        """The full weights the model-update group pushes (live tensors: the push copies them)."""
        return self.trainer.model.state_dict()

    def save(self, path: str) -> str:
        self.trainer.model.save_pretrained(path)
        return path

    def stats(self) -> dict:
        return {"busy_s": self.trainer.busy_s, "steps": float(self.trainer.steps), "cpu_s": process_tree_cpu_s()}

    def pid(self) -> int:
        return os.getpid()


def init_ray(address: str | None, num_cpus: int, extra_paths: list[str] = (), num_gpus: int = 0) -> None:
    """Join ``address`` or start a quiet local Ray whose workers see the driver's import path.

    ``num_gpus`` (local Ray only, 0 = Ray's own detection): GPUs to declare; on a CPU-only machine
    they are simulated, which is enough for placement groups (flash.placement).
    """
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if ray.is_initialized():
        return
    paths = [p for p in [*extra_paths, os.getcwd(), *sys.path] if p and os.path.isdir(p)]
    env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), **QUIET_ENV, **PERF_ENV}
    kwargs: dict[str, Any] = dict(
        include_dashboard=False, log_to_driver=True, runtime_env={"env_vars": env},
        logging_level="ERROR", configure_logging=True,
    )
    if address:
        ray.init(address=address, **kwargs)
    else:
        ray.init(num_cpus=num_cpus or os.cpu_count() or 2, num_gpus=num_gpus or None, **kwargs)


ENGINES = ("torch", "vllm")


def start_engine(model_path: str, max_num_seqs: int, seed: int, threads: int, engine: str = "torch",
                 options: dict | None = None, sleep_mode: bool = False, max_restarts: int = 0):
    """The engine actor: ``torch`` (embedded, ``EngineWorker``) or ``vllm`` (``VLLMEngineWorker``).

    Both answer the same methods, so the controller and the scheduler never know which one runs.
    ``options``: extra actor options, e.g. ``Placement.options`` (devices, placement group).
    ``sleep_mode``: the engine shares its devices and must be able to release memory (vLLM
    reserves its sleep allocator at start; the torch engine always can).
    ``max_restarts``: Ray re-creates a dead engine this many times (flash.faults recovers its work).
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


def start_trainer(model_path: str, settings, seed: int, threads: int, plugins: list[str],
                  options: dict | None = None):
    # max_concurrency 4: checkpoint snapshot/write and pid() run beside a train step (flash.checkpoint)
    actor = ray.remote(TrainerWorker).options(num_cpus=0, max_concurrency=4, **(options or {}))
    return actor.remote(model_path, settings, seed, threads, plugins, plugin_paths(plugins))


def start_critic(model_path: str, settings, seed: int, threads: int):
    """The critic role (``flash.critic.Critic``) as its own actor, for the ``gae`` estimator."""
    from flash.critic import Critic

    return ray.remote(Critic).options(num_cpus=0).remote(model_path, settings, seed, threads)


def wait_ready(*actors, timeout: float = 300.0) -> float:
    """Block until every actor answers (model loaded); returns the seconds it took."""
    start = time.monotonic()
    ray.get([a.stats.remote() for a in actors], timeout=timeout)
    return time.monotonic() - start
