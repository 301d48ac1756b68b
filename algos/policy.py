"""The policy-loss API: ``LossInputs``, the loss registry, ``resolve_loss`` and ``policy_loss``.

A loss is a pure function ``fn(inputs: LossInputs, *, knob=default, ...) -> (per_token, metrics)``
with ``per_token`` ``[batch, tokens]`` and metrics tagged with their reduction (``flash.algos.metrics``;
a bare value is a mean). ``resolve_loss`` looks it up and checks the knobs once; the ``LossFn`` it
returns adds the optional add-ons every loss takes, aggregates once (``flash.algos.aggregate``) and
returns ``(loss, metrics)`` with tensor metrics, reading nothing on the host (the trainer's path).
``policy_loss`` is both in one call with the metrics as floats. Add-ons (knob names reserved):

- ``kl_coef`` (default 0.0) · KL(π‖π_ref) per token with ``kl_estimator`` ``k1|k2|k3`` (default
  ``k3``), Schulman, "Approximating KL divergence" (2020); k3 is GRPO's estimator (arXiv
  2402.03300). With ``x = ref_logp − logp``: k1 = −x, k2 = x²/2, k3 = eˣ − 1 − x. Gradient flows
  through ``logp``. Needs ``inputs.ref_logp``. The tokens come from the behaviour policy, not π, so
  every estimator carries that (usually small) bias, as in GRPO and its peers.
- ``entropy_coef`` (default 0.0) · (−entropy) per token: an entropy bonus. Needs
  ``inputs.entropy`` (``[batch, tokens]``, carrying gradient).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Literal

import torch

from .aggregate import AGG_KNOBS, AGGREGATIONS, check_agg, masked_mean, masked_stats, reduce_tokens
from .corrections import apply_resolved, resolve_corrections, validate_corrections
from .inputs import LossInputs
from .metrics import Metric, mean, tagged, to_floats, total
from .offpolicy import Ratio, reads
from .registry import Registry

ADDON_KNOBS: dict[str, Any] = {"kl_coef": 0.0, "kl_estimator": "k3", "entropy_coef": 0.0}
_ADDON_HINTS = {"kl_coef": float, "kl_estimator": Literal["k1", "k2", "k3"], "entropy_coef": float}
_AGG_KNOB_NAMES = {k for knobs in AGG_KNOBS.values() for k in knobs}

LOSSES = Registry("loss", "flash.losses", reserved={*ADDON_KNOBS, *_AGG_KNOB_NAMES, "agg", "corrections"})
Ratios = tuple[Ratio, ...]


def register_loss(
    name: str,
    description: str | None = None,
    *,
    check: Callable[[dict], None] | None = None,
    aliases=(),
    ratios: Ratios | Callable[[dict], Ratios] | None = None,
) -> Callable:
    """Decorator registering ``fn(inputs, *, knob=default, ...) -> (per_token [B, T], metrics)``.

    Knobs and defaults come from the keyword-only parameters; ``description`` defaults to the
    docstring's first line; ``check(knobs)`` may raise ``ValueError`` for out-of-range values.
    ``ratios`` declares the policy ratios the loss uses (``flash.algos.offpolicy.Ratio``), or a function
    of its knobs (every knob, defaults filled) that returns them: ``flash losses`` shows which
    policies each loss reads, and the config refuses a ratio that a setting makes identically 1.
    None: undeclared (a plugin that says nothing is listed as such and never refused).
    """
    return LOSSES.register(name, description, check=check, aliases=aliases, meta={"ratios": ratios})


def loss_ratios(name: str, knobs: dict[str, Any] | None = None) -> Ratios | None:
    """The ratios loss ``name`` uses with ``knobs`` (defaults filled in), or None if undeclared."""
    entry = LOSSES.get(name)
    declared = entry.meta.get("ratios")
    if callable(declared):
        return tuple(declared({**entry.knobs, **{k: v for k, v in (knobs or {}).items() if k in entry.knobs}}))
    return None if declared is None else tuple(declared)


def _resolve(name: str, knobs: dict[str, Any], agg: str):
    knobs = dict(knobs)
    validate_corrections(list(knobs.pop("corrections", None) or []))
    check_agg(agg, {k: v for k, v in knobs.items() if k in _AGG_KNOB_NAMES})
    loss_knobs = {k: v for k, v in knobs.items() if k not in _AGG_KNOB_NAMES}
    entry, full = LOSSES.resolve(name, loss_knobs, ADDON_KNOBS, _ADDON_HINTS)
    return entry, full, {k: v for k, v in knobs.items() if k in _AGG_KNOB_NAMES}


def validate_loss(name: str, knobs: dict[str, Any] | None = None, agg: str | None = None) -> None:
    """Raise ``ValueError`` unless ``policy_loss(name, ..., **knobs)`` would accept ``knobs``.

    ``knobs`` may hold ``agg`` (as it does when passed on as ``**knobs``) or it may come alone.
    """
    knobs = dict(knobs or {})
    agg = knobs.pop("agg", agg) or "token-mean"
    _resolve(name, knobs, agg)


def describe_losses() -> list[dict[str, Any]]:
    """``[{name, description, knobs: {knob: default}, aliases, reads, ratios}]``; knobs include
    the add-ons; ``reads`` (policies, of behav/prox/current) and ``ratios`` (``"current/behav"``)
    are those of the default knobs, or None for a loss that declares none."""
    rows = LOSSES.describe()
    for row in rows:
        ratios = loss_ratios(row["name"])
        row["reads"] = None if ratios is None else list(reads(ratios))
        row["ratios"] = None if ratios is None else [str(r) for r in ratios]
        row["knobs"].update(ADDON_KNOBS)
    return rows


def describe_aggregations() -> list[dict[str, Any]]:
    """``[{name, description, knobs}]`` for every aggregation mode."""
    return [{"name": n, "description": d, "knobs": dict(AGG_KNOBS.get(n, {}))} for n, d in AGGREGATIONS.items()]


def kl_coef(loss: dict[str, Any]) -> float:
    """The KL add-on's coefficient in a loss section (``name`` + knobs); 0.0 when absent or null:
    nonzero means the loss reads the reference policy."""
    return float(loss.get("kl_coef", ADDON_KNOBS["kl_coef"]) or 0.0)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π‖π_ref); ``x = ref_logp − logp``: k1 = −x, k2 = x²/2,
    k3 = eˣ − 1 − x (Schulman 2020)."""
    x = ref_logp - logp
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * x.square()
    if estimator == "k3":
        return torch.expm1(x) - x
    raise ValueError(f"unknown kl_estimator {estimator!r} (valid: k1, k2, k3)")


def _common_metrics(inputs: LossInputs) -> dict[str, Metric]:
    """Ratio stats and approximate KLs (k3) of the current policy to the proximal and behaviour
    policies, all over masked tokens, and the token count (a sum)."""
    m = inputs.mask
    with torch.no_grad():
        to_prox = inputs.logp - inputs.prox_logp
        to_behav = inputs.logp - inputs.behav_logp
        out = {
            **masked_stats("ratio", to_prox.exp(), m),
            **masked_stats("ratio_behav", to_behav.exp(), m),
            "approx_kl/prox": mean(masked_mean(torch.expm1(to_prox) - to_prox, m)),
            "approx_kl/behav": mean(masked_mean(torch.expm1(to_behav) - to_behav, m)),
            "tokens": total(m.sum()),
        }
        if inputs.entropy is not None:
            out["entropy"] = mean(masked_mean(inputs.entropy, m))
    return out


@dataclass(frozen=True)
class LossFn:
    """A loss resolved once (``resolve_loss``): name, knobs and corrections checked, defaults
    filled. ``fn(inputs) -> (loss, metrics)``: ``loss`` a scalar tensor carrying gradient,
    ``metrics`` tagged 0-dim tensors (``flash.algos.metrics``); nothing is checked again and no value
    is read on the host."""

    name: str
    fn: Callable[..., Any]
    knobs: dict[str, Any]  # the loss's own, defaults filled in
    addons: dict[str, Any]  # kl_coef, kl_estimator, entropy_coef
    agg: str
    agg_knobs: dict[str, Any]
    corrections: tuple = ()  # resolved corrections (flash.algos.corrections.resolve_corrections)

    def __call__(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, Metric]]:
        weight: torch.Tensor | None = None
        correction_metrics: dict[str, Metric] = {}
        if self.corrections:
            weight, keep, correction_metrics = apply_resolved(self.corrections, inputs)
            inputs = replace(inputs, mask=inputs.mask * keep.to(inputs.mask.dtype))
        per_token, loss_metrics = self.fn(inputs, **self.knobs)
        if tuple(per_token.shape) != tuple(inputs.mask.shape):
            raise ValueError(
                f"loss {self.name!r} returned per-token loss of shape "
                f"{list(per_token.shape)}, expected {list(inputs.mask.shape)}"
            )
        if weight is not None:
            per_token = per_token * weight
        loss, pg_loss = self._aggregate(per_token, inputs)
        metrics = {k: tagged(v) for k, v in {**loss_metrics, **correction_metrics}.items()}
        metrics.update(loss=mean(loss), pg_loss=mean(pg_loss), **_common_metrics(inputs))
        if inputs.ref_logp is not None:
            metrics["kl_ref"] = mean(
                masked_mean(kl_penalty(inputs.logp.detach(), inputs.ref_logp, self.addons["kl_estimator"]), inputs.mask)
            )
        return loss, metrics

    def _aggregate(self, per_token: torch.Tensor, inputs: LossInputs):
        """(loss with the add-ons, the policy-gradient part alone), each aggregated once."""
        a = self.addons
        pg_loss = reduce_tokens(per_token, inputs.mask, self.agg, **self.agg_knobs)
        total_ = per_token
        if a["kl_coef"] != 0:
            ref = inputs.require("ref_logp", f"kl_coef={a['kl_coef']}")
            total_ = total_ + a["kl_coef"] * kl_penalty(inputs.logp, ref, a["kl_estimator"])
        if a["entropy_coef"] != 0:
            ent = inputs.require("entropy", f"entropy_coef={a['entropy_coef']}")
            total_ = total_ - a["entropy_coef"] * ent
        if total_ is per_token:
            return pg_loss, pg_loss
        return reduce_tokens(total_, inputs.mask, self.agg, **self.agg_knobs), pg_loss


def resolve_loss(name: str, agg: str = "token-mean", **knobs: Any) -> LossFn:
    """Loss ``name`` with ``knobs`` (its own, the add-ons', ``corrections`` and the aggregation's),
    checked once, as a ``LossFn`` to call on every micro-batch. Unknown ``name``, knob,
    correction or ``agg`` raises ``ValueError`` naming the closest one."""
    specs = list(knobs.get("corrections") or [])
    entry, full, agg_knobs = _resolve(name, knobs, agg)
    return LossFn(
        entry.name,
        entry.fn,
        {k: full[k] for k in entry.knobs},
        {k: full[k] for k in ADDON_KNOBS},
        agg,
        agg_knobs,
        tuple(resolve_corrections(specs)),
    )


def policy_loss(
    name: str, inputs: LossInputs, agg: str = "token-mean", **knobs: Any
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss ``name`` on ``inputs``, plus the KL / entropy add-ons, aggregated with ``agg``
    (``resolve_loss(name, agg, **knobs)(inputs)`` with the metrics read as floats).

    ``corrections=[{name, knobs...}, ...]`` (``flash.algos.corrections``) reweight and mask the tokens
    first: the loss sees the ANDed mask, its per-token terms are multiplied by the weights.
    Returns ``(loss, metrics)``: ``loss`` a scalar tensor carrying gradient, ``metrics`` a dict of
    floats (``loss``, ``pg_loss``, the loss's own clip / IS-weight stats, ratio stats,
    ``approx_kl/*``, ``corrections/*``, and ``kl_ref`` / ``entropy`` when those inputs are given).
    Unknown ``name``, knob, correction or ``agg`` raises ``ValueError`` naming the closest one.
    """
    loss, metrics = resolve_loss(name, agg, **knobs)(inputs)
    return loss, to_floats(metrics)
