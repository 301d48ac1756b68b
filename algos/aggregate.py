"""Loss aggregation (the one place where per-token terms become a scalar) and masked statistics.

With per-token loss ``l[i, t]``, mask ``m[i, t]``, ``B`` rows and ``n_i = sum_t m[i, t]``:

- ``token-mean``:              sum_{i,t} m·l / sum_{i,t} m            (DAPO, arXiv 2503.14476)
- ``seq-mean-token-mean``:     (1/B) sum_i [ sum_t m·l / n_i ]         (GRPO, arXiv 2402.03300)
- ``seq-mean-token-sum``:      (1/B) sum_i   sum_t m·l
- ``seq-mean-token-sum-norm``: (1/B) sum_i [ sum_t m·l / max_len ]     (Dr. GRPO, arXiv 2503.20783)
  ``max_len`` (default ``None``: the batch's token dimension ``T``) should be the constant maximum
  generation length so the normaliser does not depend on the batch. verl's mode of the same name
  divides the batch *sum* by ``T`` (no ``1/B``); flash keeps the ``1/B`` so all four modes share a
  scale.

``B`` counts every row, including rows with no masked token (they add 0); ``n_i`` and the token
count are floored at 1 so an empty batch gives a loss of 0 with a gradient of 0, never NaN.
"""

from __future__ import annotations

import torch

from .metrics import Metric, maximum, mean, minimum
from .registry import closest_error

AGGREGATIONS: dict[str, str] = {
    "token-mean": "mean over every masked token of the batch",
    "seq-mean-token-mean": "per-sample token mean, then mean over samples",
    "seq-mean-token-sum": "per-sample token sum, then mean over samples",
    "seq-mean-token-sum-norm": "per-sample token sum / max_len, then mean over samples (Dr. GRPO)",
}
AGG_KNOBS: dict[str, dict[str, object]] = {"seq-mean-token-sum-norm": {"max_len": None}}


def check_agg(agg: str, knobs: dict[str, object]) -> None:
    """Raise ``ValueError`` for an unknown ``agg`` or an aggregation knob it does not use."""
    if agg not in AGGREGATIONS:
        raise closest_error("aggregation", agg, AGGREGATIONS)
    allowed = AGG_KNOBS.get(agg, {})
    for key, value in knobs.items():
        if key not in allowed:
            raise ValueError(
                f"knob {key!r} only applies to aggregation 'seq-mean-token-sum-norm', not {agg!r} (it would be ignored)"
            )
        if (
            key == "max_len"
            and value is not None
            and (isinstance(value, bool) or not isinstance(value, int) or value < 1)
        ):
            raise ValueError(f"max_len must be a positive int or None, got {value!r}")


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean", max_len: int | None = None
) -> torch.Tensor:
    """Reduce ``per_token`` ``[B, T]`` to a scalar under ``mask`` ``[B, T]`` with mode ``agg``."""
    check_agg(agg, {"max_len": max_len} if max_len is not None else {})
    return reduce_tokens(per_token, mask, agg, max_len)


def reduce_tokens(per_token: torch.Tensor, mask: torch.Tensor, agg: str, max_len: int | None = None) -> torch.Tensor:
    """``aggregate`` without the check (``agg`` and ``max_len`` checked once by the caller)."""
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    if agg == "token-mean":
        return masked.sum() / mask.sum().clamp_min(1.0)
    rows = max(per_token.shape[0], 1)
    if agg == "seq-mean-token-mean":
        return (masked.sum(-1) / mask.sum(-1).clamp_min(1.0)).sum() / rows
    if agg == "seq-mean-token-sum":
        return masked.sum() / rows
    return masked.sum() / (rows * (max_len or per_token.shape[-1]))  # seq-mean-token-sum-norm


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over ``mask`` (0 when the mask is empty)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp_min(1.0)


def masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The largest ``x`` over ``mask`` (-inf when the mask is empty: ``flash.algos.metrics`` reads 0)."""
    return _extreme(x, mask, -torch.inf, torch.amax)


def masked_min(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The smallest ``x`` over ``mask`` (+inf when the mask is empty: ``flash.algos.metrics`` reads 0)."""
    return _extreme(x, mask, torch.inf, torch.amin)


def _extreme(x: torch.Tensor, mask: torch.Tensor, empty: float, fn) -> torch.Tensor:
    return fn(torch.where(mask > 0, x, empty)) if x.numel() else x.new_full((), empty)


def masked_stats(prefix: str, x: torch.Tensor, mask: torch.Tensor) -> dict[str, Metric]:
    """``{prefix/mean, prefix/max, prefix/min}`` of ``x`` over the positions where ``mask > 0``,
    tagged (``flash.algos.metrics``): a mean, a max and a min; all read 0 when the mask is empty."""
    x, keep = x.detach(), mask > 0
    return {
        f"{prefix}/mean": mean(masked_mean(x, keep)),
        f"{prefix}/max": maximum(masked_max(x, keep)),
        f"{prefix}/min": minimum(masked_min(x, keep)),
    }


def masked_frac(flag: torch.Tensor, mask: torch.Tensor) -> Metric:
    """Fraction of masked positions where ``flag`` is true (a mean)."""
    return mean(masked_mean(flag.detach().to(mask.dtype), mask))
