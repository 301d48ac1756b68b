"""The policy trainer: proximal logprobs (recomputed, fused into the step, or approximated) and the
optimizer steps of a rollout batch (``flash.train.updates``: mini-batches, epochs, lr schedule).

One process here (every FSDP2 rank, ``flash.train.fsdp``, runs this algorithm too). A step is split into
micro-batches of ``micro_batch_size`` rows whose gradients accumulate; each micro-batch's loss is
weighted by its share of the batch under the aggregation mode, so the accumulated gradient equals
the full-batch gradient whatever the micro-batch size (tested).

Logprobs are taken at the rollout temperature (``log_softmax(logits / T)``), the same distribution
the engine sampled from and reported as the behaviour logprobs, so ``prox == behav`` on the same
weights up to float error.

Devices and precision (``flash.devices``): the model trains where it lives (the worker puts it on
the device Ray gave it) and every batch moves there; the weights and the AdamW state stay float32
while the forward runs under ``autocast`` to ``model.dtype`` (none for float32); logprobs are taken
in float32 from the logits. ``activation_checkpointing`` recomputes every decoder layer in
backward (``checkpoint_activations``): a micro-batch then keeps one hidden state per layer, not
the layer's activations.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from flash import algos
import flash.algos.metrics  # noqa: F401  (loads it for the name above)
from flash.algos.proximal import approx_prox_logp
from flash.devices import autocast_dtype, model_device, release_cached_memory, use_tf32
from flash.models import decoder_layers, enable_activation_checkpointing
from flash.train.attention import causal_attention
from flash.train.batch import TrainBatch, batch_to, response_starts, to_device
from flash.train.logprobs import token_logprobs
from flash.train.updates import fresh_mismatch, lr_at, train_batch


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
    prox: str = "fused"  # what prox_logp=None means: fused (sg of the forward) | approx (flash.algos.proximal)
    # where a KL penalty's frozen reference lives (flash.train.reference): local (a copy in this
    # trainer) | role (its own placed actor; the caller passes ref_logp)
    reference: str = "local"
    dtype: str = "float32"  # model.dtype: the forward's compute precision (flash.devices)
    # log the policy's entropy on every k-th batch (0: never); a loss term that needs it
    # (entropy_coef) has it on every step
    entropy_every_steps: int = 1
    tf32: bool = True  # resources.tf32: float32 matmuls in TF32 on a CUDA device (flash.devices.use_tf32)
    # train.activation_checkpointing: every decoder layer recomputed in backward (checkpoint_activations)
    activation_checkpointing: bool = False

    @property
    def updates_per_batch(self) -> int:
        return self.mini_batches * self.update_epochs


@torch.no_grad()
def batch_logprobs(
    model,
    batch: TrainBatch,
    temperature: float,
    micro_batch_size: int,
    spans: RowSpans | None = None,
    dtype: torch.dtype | None = None,
    span_head: bool = False,
) -> torch.Tensor:
    """``[N, L-1]`` logprobs of the batch's target tokens under ``model``, no gradient, in
    micro-batches of ``micro_batch_size`` rows (forward under autocast to ``dtype`` unless None;
    ``span_head``: see ``token_logprobs``); 0 off the response mask. ``spans``: the rows' spans
    when the caller has read them (else one host read here, not one per micro-batch)."""
    out = torch.zeros_like(batch.mask)
    if spans is None:
        spans = row_spans_and_weight("seq-mean-token-mean", batch)[0]
    for lo in range(0, len(batch), micro_batch_size):
        hi = min(lo + micro_batch_size, len(batch))
        length, start = spans.of(range(lo, hi))
        part = batch.rows(lo, hi, length)
        logp, _ = token_logprobs(model, part, temperature, dtype=dtype, start=start, span_head=span_head)
        out[lo : lo + len(part), : logp.shape[1]] = logp * part.mask
    return out


def part_weight(agg: str, part: TrainBatch) -> torch.Tensor | float:
    """What a part's own aggregate stands for in a batch's: its masked tokens for ``token-mean``
    (a token mean of token means weights them by token count; a tensor, never read on the host
    here), its rows for ``seq-mean-*``."""
    return part.mask.sum() if agg == "token-mean" else float(len(part))


@dataclass(frozen=True)
class RowSpans:
    """Each row's length and first loss-mask column (``response_starts``), as read on the host."""

    lengths: list[int]
    starts: list[int]

    def of(self, rows) -> tuple[int, int]:
        """(the longest length, the earliest start) over ``rows``: a micro-batch's width and the
        first column its logprobs are computed from."""
        return max(self.lengths[i] for i in rows), min(self.starts[i] for i in rows)


def row_spans_and_weight(agg: str, batch: TrainBatch, rows: list[int] | None = None) -> tuple[RowSpans, float]:
    """Each row's span (``RowSpans``) and the ``part_weight`` of ``rows`` (default: every row),
    read on the host together: one read, however many micro-batches are cut with these spans
    (their own weights stay on the device)."""
    mask = batch.mask if rows is None else batch.mask.index_select(0, row_index(rows, batch.mask.device))
    counts = torch.cat(
        [batch.attention_mask.sum(dim=1).double(), response_starts(batch.mask).double(), mask.sum().double().reshape(1)]
    ).tolist()
    n, n_rows = len(batch), len(batch) if rows is None else len(rows)
    spans = RowSpans([int(c) for c in counts[:n]], [int(c) for c in counts[n : 2 * n]])
    return spans, counts[-1] if agg == "token-mean" else float(n_rows)


def row_index(idx: list[int], device: torch.device) -> torch.Tensor:
    """``idx`` as an index tensor on ``device``, copied without waiting for the device's queue."""
    return torch.tensor(idx, dtype=torch.long).to(device, non_blocking=True)


def micro_weight(agg: str, part: TrainBatch, whole_tokens: float, whole_rows: int) -> float:
    """Share of the full-batch aggregate that a micro-batch's own aggregate stands for."""
    whole = max(whole_tokens, 1.0) if agg == "token-mean" else max(whole_rows, 1)
    return float(part_weight(agg, part)) / whole


def checkpoint_activations(model, settings: TrainerSettings) -> None:
    """``train.activation_checkpointing``: each decoder layer of ``model`` keeps only its input and
    recomputes its activations in backward (``flash.models.enable_activation_checkpointing``, the
    one mechanism of the single trainer and of every FSDP2 rank); a second call changes nothing."""
    if settings.activation_checkpointing:
        enable_activation_checkpointing(decoder_layers(model))


def needs_local_reference(settings: TrainerSettings) -> bool:
    """Whether the trainer holds the KL reference itself: a KL penalty and no reference role."""
    return algos.kl_coef(settings.loss) != 0.0 and settings.reference == "local"


class Trainer:
    def __init__(self, model, settings: TrainerSettings, seed: int = 0):
        torch.manual_seed(seed)
        checkpoint_activations(model, settings)
        self.model = causal_attention(model)  # right-padded rows: no padding mask, no host read per forward
        self.model.train()
        self.s = settings
        self.device = model_device(model)  # batches move here; results come back to the CPU
        self.tf32 = use_tf32(self.device, settings.dtype, settings.tf32)
        self.autocast = autocast_dtype(settings.dtype)  # None: float32, no autocast context
        self.span_head = self.autocast is not None  # the response span's logits only (token_logprobs)
        self.knobs = {k: v for k, v in settings.loss.items() if k != "name"}
        self.loss_name = settings.loss["name"]
        if settings.agg == "seq-mean-token-sum-norm" and settings.max_len and "max_len" not in self.knobs:
            # a constant across micro-batches, or each would divide by its own padded width
            self.knobs["max_len"] = settings.max_len
        self.loss_fn = algos.resolve_loss(self.loss_name, agg=settings.agg, **self.knobs)  # checked once
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=settings.lr,
            weight_decay=settings.weight_decay,
            betas=tuple(settings.betas),
        )
        self.needs_entropy = float(self.knobs.get("entropy_coef", 0.0) or 0.0) != 0.0
        self.ref_model = None
        if needs_local_reference(settings):
            self.ref_model = causal_attention(self._reference_model(model))
        self.steps = 0  # rollout batches trained: the policy version
        self.optimizer_steps = 0  # the lr schedule's position (checkpointed)
        self._lr = settings.lr
        self.busy_s = 0.0

    def _reference_model(self, model):
        """The frozen KL reference: a copy of the initial weights (a sharded trainer overrides it)."""
        return copy.deepcopy(model).eval()

    def logprobs(self, batch: TrainBatch, model=None, spans: RowSpans | None = None) -> torch.Tensor:
        """Proximal logprobs: the current weights, no gradient, micro-batched; on the batch's device."""
        start = time.monotonic()
        out = batch_logprobs(
            model or self.model,
            batch_to(batch, self.device),
            self.s.temperature,
            self.s.micro_batch_size,
            spans,
            self.autocast,
            self.span_head,
        ).to(batch.mask.device)
        self.busy_s += time.monotonic() - start
        return out

    def train_step(
        self,
        batch: TrainBatch,
        advantages: torch.Tensor,
        prox_logp: torch.Tensor | None,
        ref_logp: torch.Tensor | None = None,
    ) -> dict:
        """The batch's optimizer steps (``mini_batches × update_epochs``, ``flash.train.updates``);
        returns loss and metrics as floats, means over the steps.

        ``prox_logp=None`` fuses the proximal recompute into the step's forward pass: with one
        optimizer step per batch, the weights at the start of the step *are* the weights of this
        forward, so ``prox = sg(logp)`` exactly -- one forward instead of two. With several steps
        the proximal logprobs are taken once before the first (``train_batch``). The train–inference
        mismatch |behav − prox| on tokens the current weights generated comes back as metrics.
        ``ref_logp``: the reference role's logprobs (``flash.train.reference``), else None.
        """
        batch, advantages, prox_logp, ref_logp = self._to_device(batch, advantages, prox_logp, ref_logp)
        return train_batch(self, batch, advantages, prox_logp, self.s, self.steps, ref_logp)

    def _to_device(self, batch: TrainBatch, *tensors: torch.Tensor | None) -> tuple:
        """The batch and its token-level tensors on the model's device (no copy when already there)."""
        return (batch_to(batch, self.device), *(None if t is None else to_device(t, self.device) for t in tensors))

    # ---- one optimizer step in parts (the stream trainer feeds groups as they finish) -----------
    def begin_step(self) -> None:
        """Open a step: gradients zeroed, sums empty. ``accumulate`` parts, then ``finish_step``."""
        self.optimizer.zero_grad(set_to_none=True)
        self._set_lr()
        self._metrics = algos.StepMetrics()  # on the device until the step ends
        self._busy = 0.0

    def _set_lr(self) -> None:
        """The schedule's lr for the step now opening; counts it (its position survives a resume)."""
        s = self.s
        self._lr = lr_at(
            self.optimizer_steps, s.total_optimizer_steps, s.lr, s.lr_schedule, s.warmup_steps, s.min_lr_ratio
        )
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr
        self.optimizer_steps += 1

    def accumulate(
        self,
        batch: TrainBatch,
        advantages: torch.Tensor,
        prox_logp: torch.Tensor | None,
        ref_logp: torch.Tensor | None = None,
    ) -> float:
        """Backward over ``batch`` (micro-batched) into the open step; returns its weight.

        Each micro-batch's aggregate is weighted by what it stands for in the step's aggregate
        -- its masked tokens for ``token-mean``, its rows for the ``seq-mean-*`` modes -- and the
        gradient is divided by the step's total weight in ``finish_step``. So the step does not
        need to know the batch's size in advance, and any split of the batch into parts, in any
        order, gives the full-batch update (up to float summation order). The weights, loss and
        metrics stay on the device: the call reads the host once (the rows' spans and weight).
        """
        start = time.monotonic()
        # the call's one host read, where the batch arrives (on the CPU in a run: no device sync)
        spans, weight = row_spans_and_weight(self.s.agg, batch)
        batch, advantages, prox_logp, ref_logp = self._to_device(batch, advantages, prox_logp, ref_logp)
        ref = self._reference_logprobs(batch, ref_logp, spans)
        for lo in range(0, len(batch), self.s.micro_batch_size):
            hi = min(lo + self.s.micro_batch_size, len(batch))
            length, first = spans.of(range(lo, hi))
            part = batch.rows(lo, hi, length)
            width = part.mask.shape[1]
            prox = None if prox_logp is None else prox_logp[lo:hi, :width]
            self._backward_part(
                part,
                advantages[lo:hi, :width],
                prox,
                None if ref is None else ref[lo:hi, :width],
                part_weight(self.s.agg, part),
                first,
            )
        self._busy += time.monotonic() - start
        return weight

    def _reference_logprobs(
        self, batch: TrainBatch, given: torch.Tensor | None, spans: RowSpans
    ) -> torch.Tensor | None:
        """The KL reference's logprobs: the reference role's (``given``) or the local copy's."""
        if given is not None:
            return given
        return self.logprobs(batch, self.ref_model, spans) if self.ref_model is not None else None

    def _backward_part(self, part: TrainBatch, adv, prox, ref, weight, start: int = 0):
        """Backward one micro-batch's loss at ``weight`` (a tensor, or a number: 0 for a padding
        pass) into the open step and add its tagged metrics to the step's, on the device;
        returns ``weight``. ``start``: the part's first response column (``RowSpans.of``)."""
        loss, metrics = self._micro_loss(part, adv, prox, ref, start)
        (loss * weight).backward()
        self._metrics.add(metrics, weight)
        return weight

    def finish_step(self, advance: bool = True) -> dict:
        """Scale the summed gradient to the step's aggregate, clip, and step (skipped if not finite).
        ``advance``: the batch's last optimizer step (the version counter moves on). The step's
        metrics and the gradient norm reach the host in one transfer."""
        start = time.monotonic()
        grad_norm = self._scale_and_clip(self._metrics.weight)
        partials, (norm,) = self._metrics.partials(grad_norm)
        metrics = algos.metrics.finalize(partials)
        self.metric_reductions = {name: m.reduce for name, m in partials.metrics.items()}
        loss = metrics.setdefault("loss", 0.0)
        finite = math.isfinite(norm) and math.isfinite(loss)
        if finite:
            self.optimizer.step()
        self.steps += int(advance)
        self.busy_s += self._busy + time.monotonic() - start
        metrics.update(grad_norm=norm, skipped=float(not finite), lr=self._lr)
        self.release_memory()
        return metrics

    def release_memory(self) -> None:
        """The step's end: on CUDA the allocator's freed blocks (the activations) go back to the
        driver, so what the trainer keeps between steps is its weights, gradients (read after the
        step; the next ``begin_step`` drops them) and optimizer state (for a colocated engine)."""
        release_cached_memory(self.device)

    def _scale_and_clip(self, total) -> torch.Tensor:
        """Divide the summed gradient by the step's weight ``total`` and clip it; the norm."""
        total = total.clamp_min(1e-12) if isinstance(total, torch.Tensor) else max(total, 1e-12)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.div_(total)
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.s.grad_clip)

    def logs_entropy(self) -> bool:
        """Whether this batch's steps compute the entropy: a loss term needs it, or the logging
        interval (``entropy_every_steps``) falls on this batch."""
        every = self.s.entropy_every_steps
        return self.needs_entropy or (every > 0 and self.steps % every == 0)

    def _micro_loss(self, part: TrainBatch, adv, prox, ref, start: int = 0):
        logp, entropy = token_logprobs(
            self.model,
            part,
            self.s.temperature,
            self.logs_entropy(),
            self.needs_entropy,
            self.autocast,
            start,
            self.span_head,
        )
        mismatch = {}
        if prox is None and self.s.prox == "approx":
            prox = approx_prox_logp(part.behav_logp, logp.detach(), part.versions, self.steps) * part.mask
        elif prox is None:
            prox = logp.detach() * part.mask
            mismatch = fresh_mismatch(part, prox, self.steps)
        inputs = algos.LossInputs(
            logp=logp,
            prox_logp=prox,
            behav_logp=part.behav_logp,
            advantages=adv,
            mask=part.mask,
            rewards=part.rewards,
            versions=part.versions,
            ref_logp=ref,
            entropy=entropy,
        )
        loss, metrics = self.loss_fn(inputs)
        return loss, {**metrics, **mismatch}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """CPU copies of the weights."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
