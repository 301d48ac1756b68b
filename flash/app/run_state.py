"""The run's durable state as the runner sees it: what a checkpoint holds and how a resume restores it.

Kept apart from ``flash.app.runner`` so the runner reads as its steps, and apart from
``flash.checkpoint`` (files, atomicity, the trainer's state) so neither knows the other's insides.

Order of a restore (before the scheduler starts): trainer model/optimizer/RNG from the checkpoint
→ the same weights pushed to the engine as the checkpoint's version → the buffer's groups put
back → the scheduler's data position, admission count and counters restored, and the prompts that
were in flight launched again from scratch (same prompt ids and seeds) → the guards' counters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import ray

from flash.buffers.codec import group_from_dict
from flash.app.roles import Clock, Guards, Roles, RolloutBuffer, RunFiles
from flash.app.resume import ResumePoint
from flash.checkpoint import Checkpointer, check_trainer_files, log_offsets, snapshot_rollout
from flash.checkpoint_trust import CheckpointChanged
from flash.engine.client import EngineClient
from flash.train.fsdp import group_settings

if TYPE_CHECKING:  # annotations only
    from flash.controllers.async_controller import AsyncController
    from flash.controllers.scheduler import RolloutCore
    from flash.app.config import TrainConfig
    from flash.rewards.workers import RewardPool


@dataclass
class Durable:
    """The parts of a run a checkpoint reads (beside the trainer's tensors) and a resume restores."""

    buffer: RolloutBuffer
    scheduler: RolloutCore
    clock: Clock
    guards: Guards
    client: EngineClient
    reward_pool: RewardPool | None
    checkpointer: Checkpointer
    files: RunFiles
    train: TrainConfig  # one trainer process or an FSDP2 group


def load_trainer(trainer, ckpt: Path, files: dict[str, dict]) -> int:
    """The trainer loads the checkpoint, each file checked against the verified manifest's table;
    a file changed since the driver's check is refused in one line naming it (not a Ray traceback)."""
    try:
        return ray.get(trainer.load_checkpoint.remote(str(ckpt), files))
    except ray.exceptions.RayTaskError as exc:
        if isinstance(getattr(exc, "cause", None), CheckpointChanged):
            raise CheckpointChanged(str(exc.cause)) from None
        raise


def driver_state(d: Durable, version: int) -> dict:
    """Everything but the trainer's tensors, at the quiet point after the weight push of ``version``."""
    state = snapshot_rollout(d.buffer.store, d.scheduler)
    state.update(
        {
            "version": version,
            "eval_initial": d.clock.acc0,
            "elapsed": d.clock.elapsed(),  # time/elapsed continues from here on resume
            "wall": d.clock.wall(),  # summary.json's wall_seconds, too
            "skips": {"total": d.guards.steps.total, "consecutive": d.guards.steps.consecutive},
            "data_skipped": dict(d.guards.inputs.counts),
            "faults": {"engine": d.client.faults, "reward": d.reward_pool.faults if d.reward_pool is not None else 0},
        }
    )
    return state


def on_update(d: Durable, version: int) -> None:
    """Controller hook: take the snapshot of a checkpoint that is due (steps done == version)."""
    if d.checkpointer.due(version):
        d.checkpointer.snapshot(version, driver_state(d, version))


def commit_checkpoint(checkpointer: Checkpointer, files: RunFiles) -> None:
    """After the step's logs are written: the snapshot (if one was taken) goes to disk."""
    checkpointer.commit(log_offsets(files.by_name()))


def restore(d: Durable, roles: Roles, controller: AsyncController, point: ResumePoint) -> int:
    """Bring every role to the checkpoint; returns the step to continue from."""
    ckpt, state = point.path, point.state
    check_trainer_files(ckpt, group=group_settings(d.train) is not None)
    load_trainer(roles.trainer, ckpt, point.manifest["files"])
    version = int(state["version"])
    ray.get(roles.engine.pause.remote("continue"))
    roles.model_update.push(version)  # every replica, through the model-update group
    ray.get(roles.engine.resume.remote())
    d.client.pushed(roles.trainer.get_weights.remote, version)  # a restarted engine fetches them
    controller.version = version
    groups = [group_from_dict(g, f"{ckpt.name} buffer group {i}") for i, g in enumerate(state["buffer"])]
    d.buffer.store.restore(groups)
    d.scheduler.load_state_dict(state["scheduler"], buffered_groups=groups)
    d.guards.steps.total = state["skips"]["total"]
    d.guards.steps.consecutive = state["skips"]["consecutive"]
    d.guards.inputs.counts.update(state["data_skipped"])
    d.client.faults = state["faults"]["engine"]
    if d.reward_pool is not None:  # faults/reward continues its curve
        d.reward_pool.faults = state["faults"].get("reward", 0)
    d.clock.acc0 = state.get("eval_initial")
    d.clock.elapsed0 = state.get("elapsed", 0.0)
    wall = state.get("wall")  # a checkpoint without it: its training time
    d.clock.wall0 = float(wall) if isinstance(wall, (int, float)) and 0 <= wall < math.inf else d.clock.elapsed0
    return int(state["step"])
