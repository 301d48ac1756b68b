"""The policy trainer: proximal logprobs (recomputed, fused into the step, or approximated) and the
optimizer steps of a rollout batch (``flash.train.updates``: mini-batches, epochs, lr schedule).

One process here (the multi-worker FSDP2 trainer has its own issue). A step is split into
micro-batches of ``micro_batch_size`` rows whose gradients accumulate; each micro-batch's loss is
weighted by its share of the batch under the aggregation mode, so the accumulated gradient equals
the full-batch gradient whatever the micro-batch size (tested).

Logprobs are taken at the rollout temperature (``log_softmax(logits / T)``), the same distribution
the engine sampled from and reported as the behaviour logprobs, so ``prox == behav`` on the same
weights up to float error.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

import algos
from algos.proximal import approx_prox_logp
from flash.train.batch import TrainBatch
from flash.train.updates import lr_at, train_batch


@dataclass
class TrainerSettings:
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    grad_clip: float
    micro_batch_size: int
    temperature: float
    loss: dict[str, Any]  # name + knobs
    agg: str
    max_len: int = 0  # seq-mean-token-sum-norm's constant length when the loss config has none
    mini_batches: int = 1  # optimizer steps per pass over a rollout batch (contiguous row chunks)
    update_epochs: int = 1  # passes over the batch
    lr_schedule: str = "constant"  # constant | cosine, over optimizer steps (flash.train.updates.lr_at)
    warmup_steps: int = 0  # linear warmup, in optimizer steps
    min_lr_ratio: float = 0.0  # cosine floor, a fraction of lr
    total_optimizer_steps: int = 0  # the run's: train.steps × mini_batches × update_epochs
    prox: str = "fused"  # what prox_logp=None means: fused (sg of the forward) | approx (algos.proximal)
    # where a KL penalty's frozen reference lives (flash.train.reference): local (a copy in this
    # trainer) | role (its own placed actor; the caller passes ref_logp)
    reference: str = "local"

    @property
    def updates_per_batch(self) -> int:
        return self.mini_batches * self.update_epochs


def token_logprobs(model, batch: TrainBatch, temperature: float, with_entropy: bool = False,
                   entropy_grad: bool = True):
    """Per-target-column logprob ``[N, L-1]`` (and entropy when asked) under ``model``; with
    ``entropy_grad=False`` the entropy is a metric only, computed outside the autograd graph."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logits = logits[:, :-1].float() / temperature
    logp_all = F.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@torch.no_grad()
def batch_logprobs(model, batch: TrainBatch, temperature: float, micro_batch_size: int) -> torch.Tensor:
    """``[N, L-1]`` logprobs of the batch's target tokens under ``model``, no gradient, in
    micro-batches of ``micro_batch_size`` rows; 0 off the response mask."""
    out = torch.zeros_like(batch.mask)
    for lo in range(0, len(batch), micro_batch_size):
        part = batch.rows(lo, min(lo + micro_batch_size, len(batch)))
        logp, _ = token_logprobs(model, part, temperature)
        out[lo : lo + len(part), : logp.shape[1]] = logp * part.mask
    return out


def part_weight(agg: str, part: TrainBatch) -> float:
    """What a part's own aggregate stands for in a batch's: its masked tokens for ``token-mean``
    (a token mean of token means weights them by token count), its rows for ``seq-mean-*``."""
    return float(part.mask.sum()) if agg == "token-mean" else float(len(part))


def micro_weight(agg: str, part: TrainBatch, whole_tokens: float, whole_rows: int) -> float:
    """Share of the full-batch aggregate that a micro-batch's own aggregate stands for."""
    whole = max(whole_tokens, 1.0) if agg == "token-mean" else max(whole_rows, 1)
    return part_weight(agg, part) / whole


def needs_local_reference(settings: TrainerSettings) -> bool:
    """Whether the trainer holds the KL reference itself: a KL penalty and no reference role."""
    return algos.kl_coef(settings.loss) != 0.0 and settings.reference == "local"


class Trainer:
    def __init__(self, model, settings: TrainerSettings, seed: int = 0):
        torch.manual_seed(seed)
        self.model = model
        self.model.train()
        self.s = settings
        self.knobs = {k: v for k, v in settings.loss.items() if k != "name"}
        self.loss_name = settings.loss["name"]
        if settings.agg == "seq-mean-token-sum-norm" and settings.max_len and "max_len" not in self.knobs:
            # a constant across micro-batches, or each would divide by its own padded width
            self.knobs["max_len"] = settings.max_len
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay,
            betas=tuple(settings.betas),
        )
        self.needs_entropy = float(self.knobs.get("entropy_coef", 0.0) or 0.0) != 0.0
        self.ref_model = None
        if needs_local_reference(settings):
            self.ref_model = self._reference_model(model)
        self.steps = 0  # rollout batches trained: the policy version
        self.optimizer_steps = 0  # the lr schedule's position (checkpointed)
        self._lr = settings.lr
        self.busy_s = 0.0

    def _reference_model(self, model):
        """The frozen KL reference: a copy of the initial weights (a sharded trainer overrides it)."""
        return copy.deepcopy(model).eval()

    def logprobs(self, batch: TrainBatch, model=None) -> torch.Tensor:
        """Proximal logprobs: the current weights, no gradient, micro-batched."""
        start = time.monotonic()
        out = batch_logprobs(model or self.model, batch, self.s.temperature, self.s.micro_batch_size)
        self.busy_s += time.monotonic() - start
        return out

    def train_step(self, batch: TrainBatch, advantages: torch.Tensor, prox_logp: torch.Tensor | None,
                   ref_logp: torch.Tensor | None = None) -> dict:
        """The batch's optimizer steps (``mini_batches × update_epochs``, ``flash.train.updates``);
        returns loss and metrics as floats, means over the steps.

        ``prox_logp=None`` fuses the proximal recompute into the step's forward pass: with one
        optimizer step per batch, the weights at the start of the step *are* the weights of this
        forward, so ``prox = sg(logp)`` exactly -- one forward instead of two. With several steps
        the proximal logprobs are taken once before the first (``train_batch``). The train–inference
        mismatch |behav − prox| on tokens the current weights generated comes back as metrics.
        ``ref_logp``: the reference role's logprobs (``flash.train.reference``), else None.
        """
        return train_batch(self, batch, advantages, prox_logp, self.s, self.steps, ref_logp)

    # ---- one optimizer step in parts (the stream trainer feeds groups as they finish) -----------
    def begin_step(self) -> None:
        """Open a step: gradients zeroed, sums empty. ``accumulate`` parts, then ``finish_step``."""
        self.optimizer.zero_grad(set_to_none=True)
        self._set_lr()
        self._mismatch, self._mismatch_acc = {}, [0.0, 0.0, 0.0]
        self._acc = {"loss": 0.0, "weight": 0.0, "busy": 0.0, "metrics": {}}

    def _set_lr(self) -> None:
        """The schedule's lr for the step now opening; counts it (its position survives a resume)."""
        s = self.s
        self._lr = lr_at(self.optimizer_steps, s.total_optimizer_steps, s.lr, s.lr_schedule,
                         s.warmup_steps, s.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr
        self.optimizer_steps += 1

    def accumulate(self, batch: TrainBatch, advantages: torch.Tensor, prox_logp: torch.Tensor | None,
                   ref_logp: torch.Tensor | None = None) -> float:
        """Backward over ``batch`` (micro-batched) into the open step; returns its weight.

        Each micro-batch's aggregate is weighted by what it stands for in the step's aggregate
        -- its masked tokens for ``token-mean``, its rows for the ``seq-mean-*`` modes -- and the
        gradient is divided by the step's total weight in ``finish_step``. So the step does not
        need to know the batch's size in advance, and any split of the batch into parts, in any
        order, gives the full-batch update (up to float summation order).
        """
        start = time.monotonic()
        acc = self._acc
        ref = self._reference_logprobs(batch, ref_logp)
        added = 0.0
        for lo in range(0, len(batch), self.s.micro_batch_size):
            hi = min(lo + self.s.micro_batch_size, len(batch))
            part = batch.rows(lo, hi)
            width = part.mask.shape[1]
            prox = None if prox_logp is None else prox_logp[lo:hi, :width]
            added += self._backward_part(part, advantages[lo:hi, :width], prox,
                                         None if ref is None else ref[lo:hi, :width],
                                         part_weight(self.s.agg, part))
        acc["weight"] += added
        acc["busy"] += time.monotonic() - start
        return added

    def _reference_logprobs(self, batch: TrainBatch, given: torch.Tensor | None) -> torch.Tensor | None:
        """The KL reference's logprobs: the reference role's (``given``) or the local copy's."""
        if given is not None:
            return given
        return self.logprobs(batch, self.ref_model) if self.ref_model is not None else None

    def _backward_part(self, part: TrainBatch, adv, prox, ref, weight: float) -> float:
        """Backward one micro-batch's loss at ``weight`` into the open step and add its loss and
        metrics to the step's sums; returns ``weight``."""
        acc = self._acc
        loss, m = self._micro_loss(part, adv, prox, ref)
        (loss * weight).backward()
        acc["loss"] += float(loss.detach()) * weight
        for key, value in m.items():
            acc["metrics"][key] = acc["metrics"].get(key, 0.0) + float(value) * weight
        return weight

    def finish_step(self, advance: bool = True) -> dict:
        """Scale the summed gradient to the step's aggregate, clip, and step (skipped if not finite).
        ``advance``: the batch's last optimizer step (the version counter moves on)."""
        start = time.monotonic()
        acc, total = self._acc, max(self._acc["weight"], 1e-12)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.div_(total)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.s.grad_clip)
        loss = acc["loss"] / total
        finite = bool(torch.isfinite(grad_norm)) and math.isfinite(loss)
        if finite:
            self.optimizer.step()
        self.steps += int(advance)
        self.busy_s += acc["busy"] + time.monotonic() - start
        metrics = {k: v / total for k, v in acc["metrics"].items()}
        metrics.update(loss=loss, grad_norm=float(grad_norm), skipped=float(not finite), lr=self._lr)
        metrics.update(self._mismatch)
        return metrics

    def _micro_loss(self, part: TrainBatch, adv, prox, ref):
        logp, entropy = token_logprobs(self.model, part, self.s.temperature, True, self.needs_entropy)
        if prox is None and self.s.prox == "approx":
            prox = approx_prox_logp(part.behav_logp, logp.detach(), part.versions, self.steps) * part.mask
        elif prox is None:
            prox = logp.detach() * part.mask
            self._track_mismatch(part, prox)
        inputs = algos.LossInputs(
            logp=logp, prox_logp=prox, behav_logp=part.behav_logp, advantages=adv,
            mask=part.mask, rewards=part.rewards, versions=part.versions,
            ref_logp=ref, entropy=entropy,
        )
        return algos.policy_loss(self.loss_name, inputs, agg=self.s.agg, **self.knobs)

    def _track_mismatch(self, part: TrainBatch, prox: torch.Tensor) -> None:
        fresh = part.mask * (part.versions == self.steps).float()  # made by these very weights
        n = float(fresh.sum())
        if n == 0:
            return
        diff = (part.behav_logp - prox).abs() * fresh
        acc = self._mismatch_acc
        acc[0] += float(diff.sum())
        acc[1] += n
        acc[2] = max(acc[2], float(diff.max()))
        self._mismatch = {"mismatch_mean": acc[0] / acc[1], "mismatch_max": acc[2]}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
