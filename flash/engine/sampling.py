"""Per-request seeded sampling for the torch engine (``flash.engine.torch_engine``).

Each request owns a CPU ``torch.Generator`` and draws one uniform per sampled token
(inverse-CDF sampling), so its tokens do not depend on its batch mates. A batch's temperatures,
rows and top-p values go to the device once per batch composition (``SamplingPlan``); per step
only the uniforms go up, and nothing here reads the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from flash.engine.base import GenerationRequest


class Sampled(Protocol):
    """A request being sampled: its parameters and its own generator."""

    req: GenerationRequest
    gen: torch.Generator


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor, top_p: torch.Tensor | None) -> torch.Tensor:
    """Per row, the token whose CDF bucket holds ``u`` in (0, 1]; nucleus-truncated if ``top_p``.

    With top-p the vocabulary is sorted by probability (stable) and tokens whose preceding mass is
    already >= top_p get zero weight; the top token always stays. ``u > 0`` and a strict ``<``
    mean a zero-weight token is never picked.
    """
    order = None
    if top_p is not None:
        probs, order = probs.sort(dim=-1, descending=True, stable=True)
        probs = probs.masked_fill(probs.cumsum(-1) - probs >= top_p[:, None], 0.0)
    cdf = probs.cumsum(-1)
    pick = (cdf < u[:, None] * cdf[:, -1:]).sum(-1).clamp(max=probs.shape[-1] - 1)
    return pick if order is None else order.gather(-1, pick[:, None]).squeeze(-1)


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (host) on ``device``; to a GPU from pinned memory without blocking the host."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass(frozen=True)
class SamplingPlan:
    """A batch's sampling tensors on the device, made once per batch composition: the
    temperatures (1 where greedy) and, for the sampled rows without and with top-p, their rows,
    row index and top-p values."""

    temps: torch.Tensor
    groups: tuple[tuple[list[int], torch.Tensor, torch.Tensor | None], ...]

    @classmethod
    def of(cls, seqs: list[Sampled], device: torch.device) -> SamplingPlan:
        temps = [s.req.params.temperature for s in seqs]
        t = torch.tensor([x if x > 0 else 1.0 for x in temps], dtype=torch.float32)
        groups = []
        for nucleus in (False, True):
            rows = [i for i, s in enumerate(seqs) if temps[i] > 0 and (s.req.params.top_p < 1.0) == nucleus]
            if rows:
                top_p = upload(torch.tensor([seqs[i].req.params.top_p for i in rows]), device) if nucleus else None
                groups.append((rows, upload(torch.tensor(rows), device), top_p))
        return cls(upload(t, device), tuple(groups))


def sample(
    logits: torch.Tensor, seqs: list[Sampled], plan: SamplingPlan | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token and its logprob per row of ``logits`` ``[rows, vocab]`` (float32).

    The logprob is ``log_softmax(logits / T)`` at the chosen token over the *full* vocabulary, not
    the top-p-truncated one: it is the behaviour policy at temperature T that the trainer's
    recomputation (which knows nothing of top-p) is compared with. Greedy (T = 0) takes the argmax
    and reports the raw-logit log_softmax. Each sampled row draws one uniform from its own
    generator, and rows with and without top-p take separate paths, so a row's result depends
    only on its own logits and generator. ``plan``: the batch's ``SamplingPlan`` (made here if
    None); the uniforms are the only tensor that goes to the device per call, and nothing is read.
    """
    plan = plan if plan is not None else SamplingPlan.of(seqs, logits.device)
    logp = torch.log_softmax(logits / plan.temps[:, None], dim=-1)
    tokens = logits.argmax(dim=-1)
    for rows, idx, top_p in plan.groups:
        u = 1.0 - upload(torch.cat([torch.rand(1, generator=seqs[i].gen) for i in rows]), logits.device)
        tokens[idx] = _inverse_cdf(logp[idx].exp(), u, top_p)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
