"""The trainer-role contract: what the controller, the checkpointer and the runner call on a
trainer, as small typed protocols (one per concern), like the engines' in ``flash.engine.base``.

Every policy trainer the controller may hold satisfies the five ``POLICY_PROTOCOLS``: the single
trainer (``flash.train.worker.TrainerWorker`` over ``flash.train.trainer.Trainer``), the FSDP2
group (``flash.train.trainer_group.TrainerGroup``) and the simulated trainer
(``flash.train.sim_trainer.SimTrainer``):

- ``Forward`` -- proximal (or reference) logprobs of a batch: ``logprobs``;
- ``Stepping`` -- every optimizer step of one rollout batch: ``train_step``;
- ``Streaming`` -- one optimizer step fed in parts (the stream trainer: groups as they finish):
  ``begin_step``, ``accumulate``, ``finish_step``;
- ``State`` -- weights and checkpoints: ``get_weights``, ``save``, ``checkpoint_snapshot``,
  ``checkpoint_write``, ``load_checkpoint``;
- ``Stats`` -- per-step metrics (and the readiness ping): ``stats``, with ``busy_s``.

The roles beside the policy satisfy fewer: the reference (``flash.train.reference.Reference``)
``REFERENCE_PROTOCOLS``, the critic (``flash.train.critic.Critic``) ``CRITIC_PROTOCOLS``. A
class may add parameters with defaults after a protocol's (``finish_step(advance=True)`` of the
trainers that ``flash.train.updates`` drives through several optimizer steps per batch).

Metrics: ``train_step`` returns at least ``BATCH_METRICS``, ``finish_step`` at least
``STEP_METRICS``, every value a float. Model-update-group sending (``mu_*``) is
``flash.weights.group.UpdateSender``'s.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from flash.train.batch import TrainBatch

STEP_METRICS = ("loss", "grad_norm", "skipped", "lr")  # of one optimizer step
BATCH_METRICS = STEP_METRICS + ("grad_norm_last", "optimizer_steps")  # of a batch's optimizer steps


@runtime_checkable
class Forward(Protocol):
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``[N, L-1]`` logprobs of the batch's target tokens (0 off the response mask)."""


@runtime_checkable
class Stepping(Protocol):
    def train_step(
        self,
        batch: TrainBatch,
        advantages: torch.Tensor,
        prox_logp: torch.Tensor | None,
        ref_logp: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """Every optimizer step of one rollout batch; its metrics (``BATCH_METRICS``)."""


@runtime_checkable
class Streaming(Protocol):
    def begin_step(self) -> None:
        """Open an optimizer step."""

    def accumulate(
        self,
        batch: TrainBatch,
        advantages: torch.Tensor,
        prox_logp: torch.Tensor | None,
        ref_logp: torch.Tensor | None = None,
    ) -> float:
        """Backward over ``batch`` into the open step; returns its weight."""

    def finish_step(self) -> dict[str, float]:
        """Scale, clip and take the open step; its metrics (``STEP_METRICS``)."""


@runtime_checkable
class State(Protocol):
    def get_weights(self) -> dict[str, torch.Tensor]:
        """The full weights, keys and shapes as the model's ``state_dict``."""

    def save(self, path: str) -> str:
        """The weights (a group: and optimizer) at ``path``; returns it."""

    def checkpoint_snapshot(self) -> None:
        """Copy the training state between steps (``flash.checkpoint``)."""

    def checkpoint_write(self, directory: str) -> None:
        """Write the snapshot into ``directory`` while training goes on."""

    def load_checkpoint(self, directory: str, files: dict[str, dict]) -> int:
        """Restore what ``checkpoint_write`` wrote, each file read once and checked against
        ``files`` (the verified manifest's table, ``flash.checkpoint_trust.read_verified``);
        returns the step count."""


@runtime_checkable
class Stats(Protocol):
    def stats(self) -> dict[str, float]:
        """Counters for the step's metrics, at least ``busy_s`` (seconds spent computing)."""


@runtime_checkable
class ValueModel(Protocol):
    """The critic of the ``gae`` estimator."""

    def values(self, batch: TrainBatch) -> torch.Tensor:
        """``[N, L-1]`` values on response tokens (0 elsewhere)."""

    def train_step(self, batch: TrainBatch, returns: torch.Tensor, old_values: torch.Tensor) -> dict[str, float]:
        """One optimizer step of the value loss; its metrics."""


POLICY_PROTOCOLS = (Forward, Stepping, Streaming, State, Stats)
REFERENCE_PROTOCOLS = (Forward, Stats)
CRITIC_PROTOCOLS = (ValueModel, Stats)
