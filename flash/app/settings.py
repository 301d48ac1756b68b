"""The settings a validated config names for the run's parts, as pure functions of the config:
the CPU cores the run's Ray gets and the engine/trainer torch-thread split, the sampling
parameters of rollout and evaluation, and the trainer's settings (``algo.loss`` with
``algo.corrections`` folded in).

Read by ``flash run`` (flash.app.runner), ``flash replay`` and the tests that build roles in process.
"""

from __future__ import annotations

import os

from flash.controllers.prox_mode import trainer_prox
from flash.app.config import FlashConfig
from flash.app.config_checks import steps_per_batch
from flash.app.plan_model import auto_threads
from flash.app.roles import reference_placed
from flash.engine.base import SamplingParams
from flash.train.trainer import TrainerSettings


def run_cores(cfg: FlashConfig) -> int:
    """The CPU cores the run's local Ray gets (``ray.num_cpus``, else the machine's)."""
    return cfg.ray.num_cpus or os.cpu_count() or 2


def resolve_threads(cfg: FlashConfig) -> tuple[int, int]:
    """(engine, trainer) torch threads of the run's roles (``flash.app.plan_model.auto_threads``)."""
    return auto_threads(run_cores(cfg), cfg.async_ratio, cfg.resources.engine_threads, cfg.resources.trainer_threads)


def sampling_params(cfg: FlashConfig, tokenizer, *, eval_mode: bool = False) -> SamplingParams:
    max_new = cfg.eval.max_new_tokens if eval_mode and cfg.eval.max_new_tokens else cfg.rollout.max_new_tokens
    return SamplingParams(
        max_new_tokens=max_new,
        temperature=cfg.eval.temperature if eval_mode else cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        stop_token_ids=[tokenizer.eos_token_id],
    )


def loss_section(cfg: FlashConfig) -> dict:
    """``algo.loss`` with ``algo.corrections`` folded in as the ``corrections`` knob that
    ``flash.algos.policy_loss`` takes (absent when none, so the loss knobs stay as written)."""
    loss = dict(cfg.algo.loss)
    if cfg.algo.corrections:
        loss["corrections"] = [dict(c) for c in cfg.algo.corrections]
    return loss


def trainer_settings(cfg: FlashConfig) -> TrainerSettings:
    return TrainerSettings(
        lr=cfg.train.lr,
        weight_decay=cfg.train.weight_decay,
        betas=tuple(cfg.train.betas),
        grad_clip=cfg.train.grad_clip,
        micro_batch_size=cfg.train.micro_batch_size,
        temperature=cfg.rollout.temperature,
        loss=loss_section(cfg),
        agg=cfg.algo.agg,
        max_len=cfg.rollout.max_new_tokens,
        mini_batches=cfg.train.mini_batches,
        update_epochs=cfg.train.update_epochs,
        lr_schedule=cfg.train.lr_schedule,
        warmup_steps=cfg.train.warmup_steps,
        min_lr_ratio=cfg.train.min_lr_ratio,
        total_optimizer_steps=cfg.train.steps * steps_per_batch(cfg.train),
        prox=trainer_prox(cfg.algo.recompute_prox),
        reference="role" if reference_placed(cfg) else "local",
        dtype=cfg.model.dtype,
        entropy_every_steps=cfg.train.entropy_every_steps,
        tf32=cfg.resources.tf32,
        activation_checkpointing=cfg.train.activation_checkpointing,
    )
