"""The run's durable state as the runner sees it: what a checkpoint holds and how a resume restores it.

Kept apart from ``flash.app.runner`` so the runner reads as its steps, and apart from
``flash.checkpoint`` (files, atomicity, the trainer's state) so neither knows the other's insides.

Order of a restore (before the scheduler starts): trainer model/optimizer/RNG from the checkpoint
→ the same weights pushed to the engine as the checkpoint's version → the buffer's groups put
back → the scheduler's data position, admission count and counters restored, and the prompts that
were in flight resubmitted from scratch (same prompt ids and request seeds) → the guards' counters.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import ray

from flash.checkpoint import (
    check_trainer_files,
    group_from_dict,
    log_offsets,
    snapshot_rollout,
)
from flash.train.fsdp import group_settings


def rollout_buffer(r: Any):
    """The buffer a checkpoint reads and a resume fills: with ``buffer.transport=zmq`` the service's
    own store (it lives in the driver; the runner's proxy on it only crosses the wire), else the
    in-process SampleBuffer. Both answer ``snapshot``/``restore``."""
    return r.buffer_service.buffer if getattr(r, "buffer_service", None) is not None else r.buffer


def driver_state(r: Any, version: int) -> dict:
    """Everything but the trainer's tensors, at the quiet point after the weight push of ``version``."""
    state = snapshot_rollout(rollout_buffer(r), r.scheduler)
    state.update({
        "version": version,
        "eval_initial": r.acc0,
        # time/elapsed continues from here on resume
        "elapsed": time.monotonic() - r.train_start if r.train_start is not None else 0.0,
        "skips": {"total": r.skip_guard.total, "consecutive": r.skip_guard.consecutive},
        "data_skipped": dict(r.input_guard.counts),
        "faults": {"engine": r.supervisor.faults,
                   "reward": r.reward_pool.faults if getattr(r, "reward_pool", None) is not None else 0},
    })
    return state


def on_update(r: Any, version: int) -> None:
    """Controller hook: take the snapshot of a checkpoint that is due (steps done == version)."""
    if r.checkpointer.due(version):
        r.checkpointer.snapshot(version, driver_state(r, version))


def commit_checkpoint(r: Any) -> None:
    """After the step's logs are written: the snapshot (if one was taken) goes to disk."""
    files = {"ledger": r.ledger, "metrics": r.metrics_file, "timeline": r.timeline_file, "eval": r.eval_file}
    r.checkpointer.commit(log_offsets(files))


def restore(r: Any, ckpt: Path, state: dict) -> int:
    """Bring every role to the checkpoint; returns the step to continue from."""
    check_trainer_files(ckpt, group=group_settings(r.cfg.train) is not None)
    ray.get(r.trainer.load_checkpoint.remote(str(ckpt)))
    version = int(state["version"])
    ray.get(r.engine.pause.remote("continue"))
    if r.model_update is not None:  # every replica, through the model-update group
        r.model_update.push(version)
        weights = r.trainer.get_weights.remote  # a restarted engine fetches them (flash.engine.client)
    else:
        weights = r.trainer.get_weights.remote()
        ray.get(r.engine.update_weights.remote(weights, version))
    ray.get(r.engine.resume.remote())
    r.supervisor.pushed(weights, version)
    r.controller.version = version
    groups = [group_from_dict(g) for g in state["buffer"]]
    rollout_buffer(r).restore(groups)
    r.scheduler.load_state_dict(state["scheduler"], buffered_groups=groups)
    r.skip_guard.total = state["skips"]["total"]
    r.skip_guard.consecutive = state["skips"]["consecutive"]
    r.input_guard.counts.update(state["data_skipped"])
    r.supervisor.faults = state["faults"]["engine"]
    if getattr(r, "reward_pool", None) is not None:  # faults/reward continues its curve
        r.reward_pool.faults = state["faults"].get("reward", 0)
    r.acc0 = state.get("eval_initial")
    r.elapsed0 = state.get("elapsed", 0.0)
    return int(state["step"])
