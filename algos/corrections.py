"""Corrections between the behaviour and the proximal policy, composable with any loss.

A correction is a pure function ``fn(inputs: LossInputs, *, knob=default) -> (weight, keep,
metrics)`` over the detached log-ratio ``log ρ = prox_logp − behav_logp`` (ρ = π_prox/π_behav):
``weight`` ``[B, T]`` multiplies the loss's per-token terms, ``keep`` ``[B, T]`` (bool) is ANDed
into the mask before aggregation, so a rejected token leaves the loss and its token count.
``algo.corrections: [{name: token_is, cap: 2.0}, ...]`` lists them; ``policy_loss`` applies them in
order (weights multiply, masks AND). Every correction reads behav and prox (``RATIO``), which is
why ``algo.recompute_prox`` must make prox differ from behav (``flash.algos.offpolicy``).

Why corrections are separate from losses: the engine's sampler and the trainer's forward differ
(kernels, precision) even at the same weights, and stale samples differ more; the fix is the same
whatever the surrogate (TIS, MIS, IcePop, M2PO all reweight or reject tokens by ρ).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Literal

import torch

from .aggregate import masked_frac, masked_max, masked_mean
from .inputs import LossInputs
from .metrics import Metric, maximum, mean, tagged
from .offpolicy import Ratio, mismatch_metrics
from .registry import Registry

CORRECTIONS = Registry("correction", "flash.corrections")
RATIO = Ratio("prox", "behav")  # what every correction reads
Out = tuple[torch.Tensor, torch.Tensor, dict[str, Metric]]
Mode = Literal["truncate", "mask"]


def register_correction(
    name: str, description: str | None = None, *, check: Callable[[dict], None] | None = None
) -> Callable:
    """Decorator for a user's correction, as the built-ins below are registered:
    ``fn(inputs, *, knob=default, ...) -> (weight [B, T], keep mask [B, T] (bool), metrics)``
    (metrics: ``flash.algos.metrics`` tagged values, or bare tensors and numbers, which are means),
    reading π_prox/π_behav from ``inputs``. Named in ``algo.corrections`` like any
    other once its module is in ``plugins:`` (or a ``flash.corrections`` entry point)."""
    return CORRECTIONS.register(name, description, check=check)


def _log_rho(inputs: LossInputs) -> torch.Tensor:
    """log(π_prox/π_behav) on the masked tokens, 0 elsewhere (padding never weighs or rejects)."""
    m = inputs.mask > 0
    return torch.where(m, (inputs.prox_logp - inputs.behav_logp).detach(), torch.zeros_like(inputs.mask))


def _check_bounds(k: dict) -> None:
    if k.get("cap", 1.0) <= 0:
        raise ValueError(f"cap must be > 0, got {k['cap']}")
    if not 0 <= k["low"] <= k["high"]:
        raise ValueError(f"need 0 <= low <= high, got low={k['low']}, high={k['high']}")


def _truncate_or_mask(rho: torch.Tensor, mask: torch.Tensor, mode: str, cap: float, low: float, high: float) -> Out:
    """``truncate``: weight min(ρ, cap), every token kept. ``mask``: weight ρ on the tokens with
    low ≤ ρ ≤ high, the rest rejected. ``rho`` may be per token or broadcast per sequence."""
    if mode == "truncate":
        return (
            rho.clamp(max=cap),
            torch.ones_like(mask, dtype=torch.bool),
            {"truncated_frac": masked_frac(rho > cap, mask)},
        )
    keep = (rho >= low) & (rho <= high)
    return rho, keep, {"masked_frac": masked_frac(~keep, mask)}


@CORRECTIONS.register(
    "token_is",
    "token-level importance weight ρ_t = π_prox/π_behav: truncated at cap (TIS) or rejected outside [low, high] (MIS)",
    check=_check_bounds,
    meta={"mode_knobs": {"truncate": ("cap",), "mask": ("low", "high")}},
)
def token_is(
    inputs: LossInputs, *, mode: Mode = "truncate", cap: float = 2.0, low: float = 0.5, high: float = 2.0
) -> Out:
    """TIS (Yao et al., "Your efficient RL framework secretly brings you off-policy RL training",
    2025): w_t = min(ρ_t, cap). ``mode: mask`` is masked importance sampling (MIS, as in verl's
    rollout correction): w_t = ρ_t where low ≤ ρ_t ≤ high, the token rejected otherwise."""
    return _truncate_or_mask(_log_rho(inputs).exp(), inputs.mask, mode, cap, low, high)


@CORRECTIONS.register(
    "seq_is",
    "sequence-level importance weight Π_t ρ_t: truncated at cap or the whole sequence rejected outside [low, high]",
    check=_check_bounds,
    meta={"mode_knobs": {"truncate": ("cap",), "mask": ("low", "high")}},
)
def seq_is(
    inputs: LossInputs, *, mode: Mode = "truncate", cap: float = 2.0, low: float = 0.5, high: float = 2.0
) -> Out:
    """The unbiased sequence-level weight ρ_i = Π_t ρ_t = exp(Σ_t log ρ_t), one per sample,
    broadcast to its tokens; truncated at ``cap`` or the sequence rejected outside [low, high]."""
    rho = _log_rho(inputs).sum(-1, keepdim=True).exp().expand_as(inputs.mask)
    return _truncate_or_mask(rho, inputs.mask, mode, cap, low, high)


@CORRECTIONS.register(
    "geo_is",
    "geometric mean of the token ratios per sequence: truncated at cap or the sequence rejected outside [low, high]",
    check=_check_bounds,
    meta={"mode_knobs": {"truncate": ("cap",), "mask": ("low", "high")}},
)
def geo_is(
    inputs: LossInputs, *, mode: Mode = "truncate", cap: float = 2.0, low: float = 0.5, high: float = 2.0
) -> Out:
    """ρ_i = exp(mean_t log ρ_t) (GSPO's length-normalised ratio; AReaL's sequence-level
    rejection with the ratio metric): a length-independent per-sample weight, broadcast to its
    tokens; truncated at ``cap`` or the sequence rejected outside [low, high]."""
    log_rho, m = _log_rho(inputs), inputs.mask
    rho = (log_rho.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1)).exp()
    return _truncate_or_mask(rho.expand_as(m), m, mode, cap, low, high)


@CORRECTIONS.register(
    "icepop",
    "IcePop: weight ρ_t on the tokens with low ≤ ρ_t ≤ high, the rest rejected (two-sided)",
    check=_check_bounds,
)
def icepop(inputs: LossInputs, *, low: float = 0.5, high: float = 2.0) -> Out:
    """IcePop (Ling team, Ring-1T, arXiv 2510.18855; AReaL): M(ρ_t) = ρ_t if low ≤ ρ_t ≤ high else
    0, a two-sided token mask that calibrates the kept tokens by ρ_t. Defaults 0.5 and 2.0.
    It is ``token_is`` with ``mode: mask`` under the paper's name and defaults."""
    return _truncate_or_mask(_log_rho(inputs).exp(), inputs.mask, "mask", 1.0, low, high)


def _check_tau(k: dict) -> None:
    if not k["tau"] > 0:
        raise ValueError(f"tau must be > 0, got {k['tau']}")


@CORRECTIONS.register(
    "m2po", "M2PO: reject the tokens of largest (log ρ)² until the batch's second moment is <= tau", check=_check_tau
)
def m2po(inputs: LossInputs, *, tau: float = 0.04) -> Out:
    """M2PO (Zheng et al., "Prosperity before Collapse", arXiv 2510.01161): with d_t = (log ρ_t)²
    over the batch's masked tokens, reject the k tokens of largest d_t for the smallest k whose
    kept tokens have mean d ≤ τ (M2 = E[d], the second moment of the log-ratio). Kept tokens get
    weight 1: M2PO bounds the staleness by masking, not reweighting. Default τ = 0.04 (the paper's).
    Departure: the paper takes the ratio of the current to the stale behaviour policy; flash uses
    π_prox/π_behav, the same thing at the batch's first optimizer step."""
    m = inputs.mask > 0
    d = _log_rho(inputs).square()
    # the masked d_t first, largest first (stable: ties in row order), padding last as 0s
    order = torch.argsort(torch.where(m, d, -1.0).flatten(), descending=True, stable=True)
    vals = torch.where(m, d, 0.0).flatten()[order]
    tail = vals.flip(0).cumsum(0).flip(0)  # tail[k]: sum of the masked d_t but the k largest
    n, rank = m.sum(), torch.arange(len(vals), device=vals.device)
    ok = (rank >= n) | (tail / (n - rank).clamp_min(1).to(vals.dtype) <= tau)
    ok = torch.cat([ok, torch.ones(1, dtype=torch.bool, device=vals.device)])
    k = ok.to(torch.int32).argmax()  # the smallest k whose kept mean is <= tau (all rejected at worst)
    keep = torch.empty_like(m.flatten()).scatter_(0, order, rank >= k).view_as(m)
    return (
        torch.ones_like(d),
        keep,
        {"masked_frac": masked_frac(~keep, inputs.mask), "m2": mean(masked_mean(d, inputs.mask * keep))},
    )


def validate_corrections(specs: list[dict[str, Any]]) -> None:
    """Raise ``ValueError`` unless every ``{name, knobs...}`` names a correction, once each, with
    knobs it takes and uses (``mode: truncate`` uses ``cap``, ``mode: mask`` ``low``/``high``)."""
    seen: set[str] = set()
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ValueError(f"[{i}] must be a mapping with a name (one of {CORRECTIONS.names()})")
        knobs = {k: v for k, v in spec.items() if k != "name"}
        entry, full = CORRECTIONS.resolve(spec["name"], knobs)
        if entry.name in seen:
            raise ValueError(f"[{i}] correction {entry.name!r} is listed twice; merge its knobs")
        seen.add(entry.name)
        modes = entry.meta.get("mode_knobs", {})
        unused = [k for k in knobs if any(k in names for mode, names in modes.items() if mode != full.get("mode"))]
        if unused:
            raise ValueError(
                f"[{i}] {entry.name}: knob(s) {unused} are unused with mode "
                f"{full['mode']!r}; remove them or change mode"
            )


def describe_corrections() -> list[dict[str, Any]]:
    """``[{name, description, knobs: {knob: default}, aliases, reads}]``."""
    rows = CORRECTIONS.describe()
    for row in rows:
        row["reads"] = ["behav", "prox"]
    return rows


def correction_metrics(inputs: LossInputs, weight: torch.Tensor, keep: torch.Tensor) -> dict[str, Metric]:
    """The behav-prox mismatch of the step and what the corrections made of it: KL(behav‖prox)
    by k1 = E[−log ρ] and k3 = E[ρ − 1 − log ρ] (``flash.algos.offpolicy.mismatch_metrics``; tokens
    sampled from behav), ρ's mean and max, and the effective sample size of the final weights,
    (Σw)² / (n Σw²) over the kept tokens. Means weighted as the loss's own metrics."""
    log_rho, m = _log_rho(inputs), inputs.mask
    w = weight.detach() * (m * keep)
    n = (m * keep).sum().clamp_min(1)
    rho = log_rho.exp()
    kl = mismatch_metrics(inputs.behav_logp, inputs.prox_logp, m)["mismatch_kl"]
    return {
        "corrections/kl_k1": mean(masked_mean(-log_rho, m)),
        "corrections/kl_k3": mean(kl.value),
        "corrections/ratio_mean": mean(masked_mean(rho, m)),
        "corrections/ratio_max": maximum(masked_max(rho, m)),
        "corrections/ess": mean(w.sum().square() / (n * w.square().sum()).clamp_min(1e-30)),
    }


Resolved = Sequence[tuple[str, Callable[..., Out], dict[str, Any]]]  # (name, fn, knobs) of each


def resolve_corrections(specs: list[dict[str, Any]]) -> Resolved:
    """``(name, fn, knobs)`` of each listed correction, defaults filled in (checked once)."""
    out = []
    for spec in specs:
        entry, full = CORRECTIONS.resolve(spec["name"], {k: v for k, v in spec.items() if k != "name"})
        out.append((entry.name, entry.fn, {key: full[key] for key in entry.knobs}))
    return out


def apply_resolved(resolved: Resolved, inputs: LossInputs) -> Out:
    """The product of the corrections' weights, the AND of their keep-masks, and the metrics
    (each correction's under ``corrections/<name>/``, plus ``correction_metrics``), tagged."""
    weight = torch.ones_like(inputs.mask)
    keep = torch.ones_like(inputs.mask, dtype=torch.bool)
    metrics: dict[str, Metric] = {}
    for name, fn, knobs in resolved:
        w, k, own = fn(inputs, **knobs)
        weight, keep = weight * w.detach(), keep & k
        metrics.update({f"corrections/{name}/{key}": tagged(v) for key, v in own.items()})
    metrics.update(correction_metrics(inputs, weight, keep))
    return weight, keep, metrics


def apply_corrections(specs: list[dict[str, Any]], inputs: LossInputs) -> Out:
    """``apply_resolved`` of the listed ``[{name, knobs...}, ...]``."""
    return apply_resolved(resolve_corrections(specs), inputs)
