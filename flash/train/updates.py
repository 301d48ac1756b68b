"""Several optimizer steps per rollout batch: mini-batches, epochs, and the learning-rate schedule.

A rollout batch is split into ``mini_batches`` contiguous row chunks, the same chunks in the same
order every epoch, and each chunk gets one optimizer step (``begin_step`` → ``accumulate`` →
``finish_step``, so micro-batching and the aggregation weights are those of a single step).

The proximal policy is the trainer's policy *at the start of the batch* (docs/design.md invariant 3).
The fused recompute (``prox = sg(logp)`` of the step's own forward) is exact only for the first
optimizer step, so with more than one step ``train_batch`` takes the proximal logprobs once, by a
no-grad forward before the first step, and every mini-batch and epoch reads those.

Everything here works on any trainer handle with ``logprobs``, ``begin_step``, ``accumulate`` and
``finish_step(advance)``: the one-process ``Trainer`` and the FSDP2 ``TrainerGroup`` alike.
"""

from __future__ import annotations

from collections.abc import Mapping

import math
from typing import Literal, get_args

import torch

from flash import algos
from flash.algos.metrics import Metric, to_floats
from flash.train.batch import TrainBatch

LrSchedule = Literal["constant", "cosine"]  # train.lr_schedule
LR_SCHEDULES: tuple[str, ...] = get_args(LrSchedule)


def lr_at(step: int, total: int, base_lr: float, schedule: str, warmup: int, min_ratio: float) -> float:
    """Learning rate of optimizer step ``step`` (0-based) of ``total``.

    Warmup is linear over the first ``warmup`` steps: step i uses ``base·(i+1)/warmup``, so the
    first step already moves and step ``warmup − 1`` uses ``base``. After it, ``constant`` keeps
    ``base``; ``cosine`` decays from ``base`` at step ``warmup`` towards ``base·min_ratio`` at step
    ``total`` (the step after the last one, as in the usual cosine-with-warmup schedule):

        p = (step − warmup) / (total − warmup);  lr = base·(r + (1 − r)·(1 + cos(π·p))/2)
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r} (valid: {', '.join(LR_SCHEDULES)})")
    if warmup > 0 and step < warmup:
        return base_lr * (step + 1) / warmup
    if schedule == "constant":
        return base_lr
    p = min(max((step - warmup) / max(total - warmup, 1), 0.0), 1.0)
    return base_lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p)))


def chunk_bounds(rows: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``(lo, hi)`` row ranges covering ``rows``, sizes differing by at most one
    (the first ``rows % parts`` one row longer). Refuses more parts than rows: an empty mini-batch
    would be an optimizer step on nothing, and silently taking fewer steps would shift the schedule."""
    if parts < 1:
        raise ValueError(f"mini_batches must be >= 1, got {parts}")
    if parts > rows:
        raise ValueError(
            f"train.mini_batches={parts} but the batch has only {rows} rows; set "
            f"train.mini_batches <= train.prompts_per_step × rollout.n"
        )
    size, extra = divmod(rows, parts)
    bounds, lo = [], 0
    for i in range(parts):
        hi = lo + size + (i < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def run_updates(
    trainer,
    batch: TrainBatch,
    advantages: torch.Tensor,
    prox_logp: torch.Tensor | None,
    mini_batches: int,
    update_epochs: int,
    ref_logp: torch.Tensor | None = None,
) -> list[dict]:
    """``update_epochs`` passes over ``mini_batches`` chunks, one optimizer step each; each step's
    metrics. Only the last step advances the trainer's batch counter (its version)."""

    def rows(t: torch.Tensor | None, lo: int, hi: int, whole: bool) -> torch.Tensor | None:
        return t if t is None or whole else t[lo:hi]

    bounds = chunk_bounds(len(batch), mini_batches)
    total, out = len(bounds) * update_epochs, []
    for _ in range(update_epochs):
        for lo, hi in bounds:
            whole = (lo, hi) == (0, len(batch))
            part = batch if whole else batch.rows(lo, hi)
            trainer.begin_step()
            trainer.accumulate(
                part, rows(advantages, lo, hi, whole), rows(prox_logp, lo, hi, whole), rows(ref_logp, lo, hi, whole)
            )
            out.append(trainer.finish_step(advance=len(out) + 1 == total))
    return out


def combine_updates(steps: list[dict], reductions: Mapping[str, str] = {}) -> dict:
    """One batch's metrics from its optimizer steps' metrics, each combined by its declared
    reduction (``reductions``: name → ``flash.algos.metrics`` reduce; a max stays the max over the steps,
    a sum adds up, anything undeclared is a mean: clip fraction, approximate KL, loss, ...),
    ``skipped`` if any step was, the last gradient norm beside the mean, and the number of steps.
    One step: its metrics as they are, plus the two."""
    keys = dict.fromkeys(k for s in steps for k in s)
    out = {k: _reduce_steps([s[k] for s in steps if k in s], reductions.get(k, "mean")) for k in keys}
    out["skipped"] = max(s.get("skipped", 0.0) for s in steps)
    out.update(grad_norm_last=steps[-1]["grad_norm"], optimizer_steps=float(len(steps)))
    if len(steps) == 1:
        out.update(steps[0])
    return out


def _reduce_steps(values: list[float], reduce: str) -> float:
    if reduce == "max":
        return max(values)
    if reduce == "min":
        return min(values)
    return sum(values) if reduce == "sum" else sum(values) / len(values)


def fresh_mismatch(batch: TrainBatch, prox: torch.Tensor, version: int) -> dict[str, Metric]:
    """Train–inference mismatch (``flash.algos.mismatch_metrics``: mean and max |behav − prox|, k3
    KL(behav‖prox)) on the tokens that weights ``version`` generated, as tagged tensors (the fused
    path measures it in the step; a recompute before the steps measures it in ``train_batch``)."""
    fresh = batch.mask * (batch.versions == version).to(batch.mask.dtype)
    return algos.mismatch_metrics(batch.behav_logp, prox, fresh)


def train_batch(
    trainer,
    batch: TrainBatch,
    advantages: torch.Tensor,
    prox_logp: torch.Tensor | None,
    settings,
    version: int,
    ref_logp: torch.Tensor | None = None,
) -> dict:
    """All the optimizer steps of one batch (``settings``: the ``TrainerSettings``); metrics.

    ``prox_logp=None`` under the fused mode with several steps: the proximal logprobs are taken
    here, once, before the first step (see the module docstring). Under ``approx`` they stay None:
    each forward interpolates its own (``flash.algos.proximal``)."""
    extra: dict[str, float] = {}
    several = settings.mini_batches * settings.update_epochs > 1
    if prox_logp is None and several and settings.prox == "fused":
        prox_logp = trainer.logprobs(batch)
        extra = to_floats(fresh_mismatch(batch, prox_logp, version))
    steps = run_updates(trainer, batch, advantages, prox_logp, settings.mini_batches, settings.update_epochs, ref_logp)
    return {**combine_updates(steps, getattr(trainer, "metric_reductions", {})), **extra}
