"""One rank of the FSDP2 trainer: a ``Trainer`` whose model is sharded with ``fully_shard``.

Each rank is a Ray actor process in one torch.distributed group (gloo on CPU, NCCL on GPU: the
device Ray gave the rank, ``flash.devices.actor_device``). Every
decoder layer and the root model are ``fully_shard``-ed: each rank stores 1/N of every parameter,
gradient and AdamW moment; a layer's full weights exist only while it runs (all-gather), and
gradients are reduce-scattered as each layer's backward ends.

The algorithm is the single-process ``Trainer``'s, reused, not forked: the step in parts
(``begin_step`` / accumulate / finish), the loss of a micro-batch (``Trainer._micro_loss`` →
``flash.algos.resolve_loss``), its weight (``part_weight``: masked tokens for token-mean, rows for the
seq-mean modes) and the fused proximal policy with its mismatch tracking. What differs is only
*which rows* a rank trains on (a plan from ``flash.train.microbatch``, made by the group), the
divisor of the summed gradient -- the *global* weight of the whole step (all ranks' tokens or
rows), not the rank's -- and the metrics, which the group combines by their reduction
(``flash.algos.metrics.combine``: means by weight, a max the max over ranks). Gradients are reduced
with SUM (FSDP's default is the mean over ranks, which would divide by N a second time), so the
result is the full-batch gradient of the single-process trainer.
"""

from __future__ import annotations

import math
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flash.devices import actor_device, torch_dtype
from flash.models import decoder_layers
from flash.train.batch import TrainBatch
from flash.train.microbatch import Plan
from flash.train.trainer import (
    Trainer,
    TrainerSettings,
    checkpoint_activations,
    needs_local_reference,
    part_weight,
    row_index,
    row_spans_and_weight,
    token_logprobs,
)

COLLECTIVE_TIMEOUT_S = 600  # a dead peer fails the step after this, instead of hanging forever


@dataclass
class GroupSettings:
    """The FSDP2 group's own knobs (``train.workers`` and friends in the config)."""

    workers: int = 1
    micro_tokens: int = 0  # padded tokens per micro-batch; 0: only train.micro_batch_size rows

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"train.workers must be >= 1, got {self.workers}")
        if self.micro_tokens < 0:
            raise ValueError(f"train.micro_tokens must be >= 0 (0 = no token budget), got {self.micro_tokens}")


def group_settings(train) -> GroupSettings | None:
    """The group's knobs from the ``train`` config section, or None for the single-process trainer.

    A group is used when ``workers`` > 1 or any group knob is set (a one-rank group then), so that
    no knob the user set is silently ignored. ``train.activation_checkpointing`` is a trainer knob
    (``TrainerSettings``), which the single trainer honours too: it asks for no group.
    """
    group = GroupSettings(workers=train.workers, micro_tokens=train.micro_tokens)
    return None if group == GroupSettings() else group


def take_rows(batch: TrainBatch, idx: list[int], lengths: list[int] | None = None) -> TrainBatch:
    """Rows ``idx`` (any order) of ``batch``, trimmed to the longest of them (``lengths``: every
    row's length, when the caller has read them)."""
    index = row_index(idx, batch.input_ids.device)
    if lengths is None:
        length = int(batch.attention_mask.index_select(0, index).sum(dim=1).max())
    else:
        length = max(lengths[i] for i in idx)
    pick = lambda t, cols=None: t.index_select(0, index) if cols is None else t.index_select(0, index)[:, :cols]
    return TrainBatch(
        input_ids=pick(batch.input_ids, length),
        attention_mask=pick(batch.attention_mask, length),
        mask=pick(batch.mask, length - 1),
        behav_logp=pick(batch.behav_logp, length - 1),
        versions=pick(batch.versions, length - 1),
        rewards=pick(batch.rewards),
        group_ids=pick(batch.group_ids),
    )


def shard_model(model, mesh, dtype: str = "float32") -> None:
    """``fully_shard`` each decoder layer, then the root (embeddings, final norm, LM head).

    ``dtype`` (``model.dtype``): the parameters' dtype in compute; the sharded master weights, the
    AdamW state and the gradient reduction stay float32. Gradient reduction is a plain SUM (divide
    factor 1, and gloo has no premultiplied sum): the step divides the summed gradient by the
    *global* weight itself (``planned_finish``).
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    compute = torch_dtype(dtype)
    policy = (
        MixedPrecisionPolicy()
        if compute == torch.float32
        else MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


class ShardedTrainer(Trainer):
    """The Trainer's algorithm over a sharded model and a planned slice of the batch."""

    def __init__(self, model, settings: TrainerSettings, mesh, device, seed: int = 0):
        import copy

        self.device = device
        local = needs_local_reference(settings)
        self._ref = copy.deepcopy(model).eval() if local else None  # before sharding: its own FSDP units
        model.to(device)
        checkpoint_activations(model, settings)  # before sharding: the recompute wraps FSDP's hooks
        shard_model(model, mesh, settings.dtype)
        if self._ref is not None:
            self._ref.to(device)
            shard_model(self._ref, mesh, settings.dtype)
        super().__init__(model, settings, seed=seed)
        self.autocast = None  # fully_shard's policy computes in settings.dtype

    def _reference_model(self, model):
        return self._ref

    @torch.no_grad()
    def planned_logprobs(self, batch: TrainBatch, plan: Plan, model=None) -> torch.Tensor:
        """``[N, L-1]`` logprobs on this rank's rows, zeros elsewhere (ranks' outputs add up)."""
        model = model or self.model
        out = torch.zeros_like(batch.mask)
        spans = row_spans_and_weight(self.s.agg, batch)[0]  # one host read, not one per micro-batch
        for mb in plan:
            idx = mb or self._pad_row(plan)
            part = take_rows(batch, idx, spans.lengths)
            logp, _ = token_logprobs(model, part, self.s.temperature, start=spans.of(idx)[1], span_head=self.span_head)
            if mb is not None:  # a padding pass only keeps the collectives in step
                out[row_index(mb, out.device), : logp.shape[1]] = logp * part.mask
        return out

    @staticmethod
    def _pad_row(plan: Plan) -> list[int]:
        rows = [i for mb in plan if mb for i in mb]
        return rows[:1] or [0]

    def planned_accumulate(self, batch: TrainBatch, advantages, prox_logp, plan: Plan, ref_logp=None) -> float:
        """``Trainer.accumulate`` over this rank's planned rows: backward into the open step
        (``begin_step``), each micro-batch weighted by what it stands for (``part_weight``); a
        padding pass weighs 0. Returns this rank's weight; the group sums them over ranks.
        ``ref_logp``: the reference role's logprobs (all rows), else the local copy's."""
        start = time.monotonic()
        ref = ref_logp
        if ref is None and self.ref_model is not None:
            ref = self.planned_logprobs(batch, plan, self.ref_model)
        real = [i for mb in plan if mb for i in mb]
        spans, weight = row_spans_and_weight(self.s.agg, batch, real)  # the call's one host read
        for mb in plan:
            idx = mb or self._pad_row(plan)
            part = take_rows(batch, idx, spans.lengths)
            width = part.mask.shape[1]
            # a padding pass: prox given, so it adds nothing to the mismatch metrics either
            prox = _cut(prox_logp, idx, width) if mb is not None else part.behav_logp
            self._backward_part(
                part,
                _cut(advantages, idx, width),
                prox,
                _cut(ref, idx, width),
                part_weight(self.s.agg, part) if mb is not None else 0.0,
                spans.of(idx)[1],
            )
        self._busy += time.monotonic() - start
        return weight

    def planned_finish(self, total: float, advance: bool = True) -> dict:
        """``Trainer.finish_step`` with the step's *global* weight ``total`` (all ranks' parts).

        The reduce-scattered gradient is the sum over ranks; dividing it by the global total gives
        the single-process gradient. Returns this rank's metric partials (``flash.algos.metrics``), which
        the group combines by each metric's reduction; they, the gradient norm and the global loss
        (summed over ranks, so every rank agrees on skipping a non-finite step) reach the host in
        one transfer.
        """
        start = time.monotonic()
        grad_norm = self._scale_and_clip(total)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        loss_sum = self._metrics.weighted_sum("loss", self.device)
        dist.all_reduce(loss_sum)
        partials, (norm, global_loss) = self._metrics.partials(grad_norm, loss_sum)
        finite = math.isfinite(norm) and math.isfinite(global_loss)
        if finite:
            self.optimizer.step()
        self.steps += int(advance)  # only a batch's last optimizer step moves the version on
        self.busy_s += self._busy + time.monotonic() - start
        self.release_memory()
        return {"partials": partials, "grad_norm": norm, "skipped": float(not finite), "lr": self._lr}

    def planned_step(self, batch: TrainBatch, advantages, prox_logp, plan: Plan, total: float) -> dict:
        """One optimizer step over this rank's rows; ``total``: the batch's global weight."""
        self.begin_step()
        self.planned_accumulate(batch, advantages, prox_logp, plan)
        return self.planned_finish(total)


def _cut(t: torch.Tensor | None, idx: list[int], width: int) -> torch.Tensor | None:
    """Rows ``idx`` of a token-level ``[N, L-1]`` tensor, trimmed to a micro-batch's width."""
    return None if t is None else t.index_select(0, row_index(idx, t.device))[:, :width]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks; another process could take it before rank 0
    binds it, which fails ``setup`` loudly rather than joining the wrong group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def pick_device() -> tuple[torch.device, str]:
    """(device, backend): the GPU Ray gave this rank with NCCL (``flash.devices.actor_device``),
    else the CPU with gloo."""
    device = actor_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        return device, "nccl"
    return device, "gloo"
