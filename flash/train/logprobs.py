"""Per-token logprobs (and entropy) of a batch under a model, over the response span, in chunks.

The policy's vocabulary dominates a micro-batch's memory: at Qwen2.5's 151,936 ids one 8 × 1024
micro-batch holds 4.6 GiB per fp32 copy of its logits. ``token_logprobs`` therefore

- scores only target columns from ``start`` on (the micro-batch's first response column: prompt
  columns carry no loss) and returns 0 before it;
- takes ``log_softmax`` chunk by chunk along the sequence (``chunk_bytes`` of fp32 per chunk), so
  no fp32 copy of the whole batch's vocabulary rows exists: ``_SpanLogprobs`` keeps only the
  forward's logits for its backward and recomputes each chunk's softmax there, writing the
  chunk's gradient into one logits-sized gradient;
- computes the entropy only when asked (a loss term that needs it, or the trainer's logging
  interval, ``train.entropy_every_steps``).

Numerics: each chunk runs the ops of the unchunked computation (``float``, ``/ T``,
``log_softmax``, ``gather``, the entropy) on whole vocabulary rows, and every op is row-wise, so
logprobs, entropies and the logits' gradient are bit for bit those of one pass over the batch
(tested with ``torch.equal``). In float32 the vocabulary projection still runs over every position
(a projection over fewer rows sums its weight gradient in another order, which would change
float32 training in the last bits); when the forward computes in a lower precision (bf16 on a GPU)
the model is asked for the logits of the response span only (``logits_to_keep``).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from flash.devices import autocast
from flash.train.batch import TrainBatch

# fp32 bytes of one chunk's vocabulary rows (every row of the micro-batch, a run of columns):
# 256 MiB is 55 columns of an 8-row micro-batch at a 151,936-id vocabulary; a tiny model's whole
# micro-batch is one chunk.
CHUNK_BYTES = 1 << 28


def token_logprobs(
    model,
    batch: TrainBatch,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    dtype: torch.dtype | None = None,
    start: int = 0,
    span_head: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
):
    """Per-target-column logprob ``[N, L-1]`` (and entropy ``[N, L-1]`` when asked, else None)
    under ``model``, in float32 whatever the forward's precision (``dtype``: autocast to it; None:
    none). Columns before ``start`` (clamped to the last column) are 0, not computed.
    ``span_head``: ask the model for the logits from ``start`` on only (a lower-precision
    forward; see the module docstring). With ``entropy_grad=False`` the entropy is a metric only,
    outside the autograd graph."""
    width = batch.input_ids.shape[1] - 1
    start = min(max(int(start), 0), width - 1)
    kwargs = {"logits_to_keep": width + 1 - start} if span_head and _takes_logits_to_keep(model) else {}
    with autocast(batch.input_ids.device, dtype):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False, **kwargs).logits
    offset = width + 1 - logits.shape[1]  # the position of logits[:, 0]
    columns = chunk_columns(len(batch), logits.shape[-1], chunk_bytes)
    logp, entropy = _SpanLogprobs.apply(
        logits,
        batch.input_ids[:, 1:],
        float(temperature),
        offset,
        start,
        columns,
        with_entropy,
        with_entropy and entropy_grad,
    )
    logp = F.pad(logp, (start, 0))
    return logp, (F.pad(entropy, (start, 0)) if with_entropy else None)


def chunk_columns(rows: int, vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Columns per chunk: as many as keep ``rows × columns × vocab`` fp32 values within
    ``chunk_bytes`` (at least one)."""
    return max(1, chunk_bytes // max(1, rows * vocab * 4))


def _chunk(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
    """One chunk's logprobs of ``targets`` and (optionally) entropies: the unchunked ops, row-wise."""
    logp_all = F.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    return logp, entropy


def _takes_logits_to_keep(model) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return False


class _SpanLogprobs(torch.autograd.Function):
    """Logprobs (and entropies) of target columns ``start..`` from ``logits`` (whose first
    position is ``offset``), ``columns`` at a time; saves only ``logits`` and the targets, and
    recomputes each chunk in backward."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, offset, start, columns, with_entropy, entropy_grad):
        ctx.set_materialize_grads(False)
        ctx.args = (temperature, offset, start, columns, with_entropy)
        ctx.save_for_backward(logits, targets)
        logps, entropies = [], []
        for lo, hi in _spans(start, targets.shape[1], columns):
            logp, entropy = _chunk(logits[:, lo - offset : hi - offset], targets[:, lo:hi], temperature, with_entropy)
            logps.append(logp)
            entropies.append(entropy)
        entropy = torch.cat(entropies, dim=1) if with_entropy else logits.new_empty(0, dtype=torch.float32)
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return torch.cat(logps, dim=1), entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, targets = ctx.saved_tensors
        temperature, offset, start, columns, with_entropy = ctx.args
        if grad_logp is None and grad_entropy is None:
            return (None,) * 8
        grad = torch.zeros_like(logits)
        for lo, hi in _spans(start, targets.shape[1], columns):
            x = logits[:, lo - offset : hi - offset].detach().requires_grad_(True)
            with torch.enable_grad():
                logp, entropy = _chunk(x, targets[:, lo:hi], temperature, with_entropy)
            outs = [(logp, grad_logp), (entropy, grad_entropy if with_entropy else None)]
            outs = [(o, g[:, lo - start : hi - start]) for o, g in outs if g is not None]
            (grad[:, lo - offset : hi - offset],) = torch.autograd.grad([o for o, _ in outs], [x], [g for _, g in outs])
        return grad, None, None, None, None, None, None, None


def _spans(start: int, stop: int, columns: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + columns, stop)) for lo in range(start, stop, columns)]
