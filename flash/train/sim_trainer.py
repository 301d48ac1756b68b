"""The simulated trainer (``train.backend: sim``): ``TrainerWorker``'s methods with GPU time.

A step sleeps ``6 · params · tokens · passes / (GPUs · peak · MFU)`` simulated seconds
(``flash.sim.cost.train_step_s``) scaled by ``sim.time_scale``, where ``tokens`` are the batch's
prompt and response tokens in simulated units (``sim.token_scale`` per id, ``sim.prompt_tokens``
per prompt when set) and ``passes`` is ``update_epochs``; the proximal-logprob forward, when the
controller asks for one, costs a third of that. Its metrics have the real trainer's keys; the loss
is the batch's mean advantage-weighted behaviour logprob (finite, data-dependent, never a model's).
The weights are one tensor, the step count, so the model-update group, checkpoints and resume
run their real code paths with it.
"""

from __future__ import annotations

import io
import os
import threading
import time
from pathlib import Path

import ray
import torch

from flash.sim import cost as costs
from flash.sim.config import SimConfig, cost_model
from flash.train.batch import TrainBatch
from flash.usage import process_tree_cpu_s
from flash.weights.group import UpdateSender

WEIGHT_NAME = "sim.version"  # as flash.engine.sim_engine.WEIGHT_NAME: what the engines load


class SimTrainer(UpdateSender):
    def __init__(self, sim: SimConfig, settings, seed: int = 0):
        self.sim, self.cm = sim, cost_model(sim)
        self.settings = settings
        self.steps = 0
        self.busy_s = self.sim_busy_s = 0.0
        self._open: dict | None = None  # the stream trainer's step in parts: tokens and metrics so far
        self._lock = threading.Lock()
        self._snapshot: dict | None = None

    # ---- time --------------------------------------------------------------------------------
    def _tokens(self, batch: TrainBatch) -> float:
        """Simulated tokens of ``batch``: prompts (``sim.prompt_tokens`` each when set) + responses."""
        s = self.sim
        if s.prompt_tokens:
            return float(batch.mask.sum()) * s.token_scale + len(batch) * s.prompt_tokens
        return float(batch.attention_mask.sum()) * s.token_scale

    def _spend(self, simulated_s: float) -> None:
        start = time.monotonic()
        time.sleep(simulated_s * self.sim.time_scale)
        self.busy_s += time.monotonic() - start
        self.sim_busy_s += simulated_s

    def step_seconds(self, batch: TrainBatch) -> float:
        """Simulated seconds of one train step over ``batch`` (all its optimizer steps)."""
        return costs.train_step_s(self.cm, self._tokens(batch), self.sim.train_gpus, self.settings.update_epochs)

    # ---- the trainer's methods ----------------------------------------------------------------
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """The proximal logprobs: behaviour's (no model), after a forward's simulated time."""
        self._spend(costs.forward_s(self.cm, self._tokens(batch), self.sim.train_gpus))
        return batch.behav_logp.clone()

    def train_step(self, batch: TrainBatch, advantages, prox_logp, ref_logp=None) -> dict:
        with self._lock:
            self._spend(self.step_seconds(batch))
            self.steps += 1
            return self._metrics(synthetic_loss(batch, advantages))

    def begin_step(self) -> None:
        self._open = {"loss": 0.0, "weight": 0.0}

    def accumulate(self, batch: TrainBatch, advantages, prox_logp, ref_logp=None) -> float:
        if self._open is None:
            raise RuntimeError("accumulate outside a step: call begin_step first")
        self._spend(self.step_seconds(batch))
        weight = float(batch.mask.sum())
        self._open["loss"] += synthetic_loss(batch, advantages) * weight
        self._open["weight"] += weight
        return weight

    def finish_step(self) -> dict:
        if self._open is None:
            raise RuntimeError("finish_step outside a step: call begin_step first")
        with self._lock:
            acc, self._open = self._open, None
            self.steps += 1
            return self._metrics(acc["loss"] / max(acc["weight"], 1.0))

    def _metrics(self, loss: float) -> dict:
        updates = float(self.settings.updates_per_batch)
        return {
            "loss": loss,
            "grad_norm": 1.0 / (1.0 + self.steps),
            "skipped": 0.0,
            "lr": self.settings.lr,
            "grad_norm_last": 1.0 / (1.0 + self.steps),
            "optimizer_steps": updates,
        }

    # ---- weights and checkpoints ------------------------------------------------------------
    def get_weights(self) -> dict:
        return {WEIGHT_NAME: torch.tensor([float(self.steps)])}

    def _mu_state(self) -> dict:
        return self.get_weights()

    def save(self, path: str) -> str:
        os.makedirs(path, exist_ok=True)
        torch.save({"steps": self.steps}, os.path.join(path, "sim_trainer.pt"))
        return path

    def checkpoint_snapshot(self) -> None:
        with self._lock:
            self._snapshot = {"steps": self.steps, "sim_busy_s": self.sim_busy_s}

    def checkpoint_write(self, directory: str) -> None:
        from flash.checkpoint import write_snapshot

        snapshot, self._snapshot = self._snapshot, None
        write_snapshot(snapshot, directory)

    def load_checkpoint(self, directory: str, files: dict[str, dict]) -> int:
        from flash.checkpoint import TRAINER
        from flash.checkpoint_trust import read_verified

        data = read_verified(Path(directory), TRAINER, files)
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        with self._lock:
            self.steps, self.sim_busy_s = int(state["steps"]), float(state["sim_busy_s"])
        return self.steps

    def stats(self) -> dict:
        return {
            "busy_s": self.busy_s,
            "steps": float(self.steps),
            "cpu_s": process_tree_cpu_s(),
            "sim_busy_s": self.sim_busy_s,
        }

    def pid(self) -> int:
        return os.getpid()


def synthetic_loss(batch: TrainBatch, advantages) -> float:
    """``−mean(advantage · behaviour logprob)`` over response tokens: finite, and 0 for an empty mask."""
    mask = batch.mask
    n = float(mask.sum())
    if n == 0:
        return 0.0
    adv = advantages if advantages.dim() == mask.dim() else advantages[:, None].expand_as(mask)
    return float(-(adv * batch.behav_logp * mask).sum() / n)


def start_sim_trainer(sim: SimConfig, settings, seed: int, options: dict | None = None):
    """The simulated trainer actor (``max_concurrency`` as ``start_trainer``: checkpoints beside a step)."""
    actor = ray.remote(SimTrainer).options(num_cpus=0, max_concurrency=4, **(options or {}))
    return actor.remote(sim, settings, seed)
