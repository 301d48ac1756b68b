"""The trainer as a Ray actor (``TrainerWorker``), and ``start_trainer`` / ``start_critic``.

The actor owns its torch thread count (see ``flash.engine.torch_worker``), imports the run's
plugin modules (a user's losses) before it builds the trainer, trains on the device Ray gave it
(``flash.devices.actor_device``), and answers checkpoint calls beside a train step.
"""

from __future__ import annotations

import os
import sys
import threading

import ray
import torch

from flash.cluster import load_model, plugin_paths
from flash.devices import actor_device, read_peak_memory
from flash.staging import HostStager
from flash.usage import process_tree_cpu_s
from flash.weights.group import UpdateSender


class TrainerWorker(UpdateSender):
    def __init__(self, model_path: str, settings, seed: int, threads: int, plugins: list[str], paths: list[str] = ()):
        from flash import algos
        from flash.train.trainer import Trainer

        torch.set_num_threads(max(1, threads))
        sys.path[:0] = [p for p in paths if p not in sys.path]
        algos.load_plugins(list(plugins))
        self.trainer = Trainer(load_model(model_path).to(actor_device()), settings, seed=seed)
        self._lock = threading.Lock()  # a checkpoint snapshot never sees half a step
        self._snapshot: dict | None = None
        self._stager = HostStager()  # the snapshot's host buffers, reused by the next one

    def logprobs(self, batch):
        return self.trainer.logprobs(batch).cpu()

    def train_step(self, batch, advantages, prox_logp, ref_logp=None) -> dict:
        with self._lock:
            return self.trainer.train_step(batch, advantages, prox_logp, ref_logp)

    # Checkpoint hooks (flash.checkpoint): a copy taken between steps, written while training goes
    # on. An FSDP2 trainer replaces the three functions with torch.distributed.checkpoint.
    def checkpoint_snapshot(self) -> None:
        from flash.checkpoint import trainer_state

        with self._lock:
            self._snapshot = trainer_state(self.trainer, self._stager)

    def checkpoint_write(self, directory: str) -> None:
        from flash.checkpoint import write_snapshot

        snapshot, self._snapshot = self._snapshot, None
        write_snapshot(snapshot, directory)

    def load_checkpoint(self, directory: str, files: dict[str, dict]) -> int:
        from flash.checkpoint import load_trainer_state

        with self._lock:
            return load_trainer_state(self.trainer, directory, files)

    def begin_step(self) -> None:
        self.trainer.begin_step()

    def accumulate(self, batch, advantages, prox_logp, ref_logp=None) -> float:
        return self.trainer.accumulate(batch, advantages, prox_logp, ref_logp)

    def finish_step(self) -> dict:
        with self._lock:
            return self.trainer.finish_step()

    def get_weights(self) -> dict:
        with self._lock:  # never half a step (a restarted engine may ask during one: flash.engine.client)
            return self.trainer.state_dict()

    def _mu_state(self) -> dict:
        """The full weights the model-update group pushes (live tensors: the push copies them)."""
        return self.trainer.model.state_dict()

    def save(self, path: str) -> str:
        self.trainer.model.save_pretrained(path)
        return path

    def stats(self) -> dict:
        return {
            "busy_s": self.trainer.busy_s,
            "steps": float(self.trainer.steps),
            "cpu_s": process_tree_cpu_s(),
            **read_peak_memory(self.trainer.device),
        }

    def pid(self) -> int:
        return os.getpid()


def start_trainer(model_path: str, settings, seed: int, threads: int, plugins: list[str], options: dict | None = None):
    # max_concurrency 4: checkpoint snapshot/write and pid() run beside a train step (flash.checkpoint)
    actor = ray.remote(TrainerWorker).options(num_cpus=0, max_concurrency=4, **(options or {}))
    return actor.remote(model_path, settings, seed, threads, plugins, plugin_paths(plugins))


def start_critic(model_path: str, settings, seed: int, threads: int):
    """The critic role (``flash.train.critic.Critic``) as its own actor, for the ``gae`` estimator."""
    from flash.train.critic import Critic

    return ray.remote(Critic).options(num_cpus=0).remote(model_path, settings, seed, threads)
