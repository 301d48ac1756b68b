"""Which policies a loss or a correction reads, and the rule that refuses a ratio that is
identically 1 (docs/design.md invariants 3 and 6).

Three policies meet in every step: **behav** (the engine that sampled the tokens), **prox** (the
trainer's weights at the start of the rollout batch) and **current** (the forward being trained).
A loss or correction declares its ratios as ``Ratio(num, den, role)``, pi_num / pi_den:

- role ``"is"``: an importance ratio, the part that corrects for off-policy samples;
- role ``"trust"``: a trust-region ratio (decoupled PPO's clip against prox), which only
  constrains several optimizer steps on one batch and is never a correction on its own.

Where prox comes from (``prox_source``, the controller's ``prox_mode``) makes two policies the same:

    behav     prox ≡ behav                              (recompute_prox never, or auto at r = 0)
    fused     prox ≡ current  iff one optimizer step per batch (sg(logp) of the forward; with several
              the trainer takes prox once at the start of the batch)
    approx    never identical (an interpolation by version, flash.algos.proximal)
    separate  prox ≡ current  iff one optimizer step per batch (the same weights, a second forward)

Rule (``ratio_problem``): an ``"is"`` ratio between two identical policies is a no-op correction
and is refused, with one exception: a loss's own pi_prox / pi_behav at async_ratio 0 -- samples are
on-policy, prox is behav up to the train-inference mismatch, and the loss is its on-policy form
(decoupled PPO is PPO). A correction the user listed (``explicit``) gets no exception: asking for
a behav-prox correction and getting a weight of 1 is exactly the silent no-op refused here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from .aggregate import masked_max, masked_mean
from .metrics import Metric, maximum, mean

POLICIES = ("behav", "prox", "current")


@dataclass(frozen=True)
class Ratio:
    """pi_num / pi_den, each one of ``POLICIES``; ``role`` ``"is"`` or ``"trust"``."""

    num: str
    den: str
    role: str = "is"

    def __post_init__(self) -> None:
        if {self.num, self.den} - set(POLICIES) or self.num == self.den:
            raise ValueError(f"a ratio is between two of {POLICIES}, got {self.num}/{self.den}")
        if self.role not in ("is", "trust"):
            raise ValueError(f"ratio role must be 'is' or 'trust', got {self.role!r}")

    def __str__(self) -> str:
        return f"{self.num}/{self.den}" + (" (trust region)" if self.role == "trust" else "")


def reads(ratios: Iterable[Ratio]) -> tuple[str, ...]:
    """The policies ``ratios`` touch plus ``current`` (every loss trains it), in ``POLICIES`` order."""
    used = {"current"} | {p for r in ratios for p in (r.num, r.den)}
    return tuple(p for p in POLICIES if p in used)


def same_policies(prox_source: str, steps_per_batch: int) -> frozenset[str]:
    """The pair that is one policy under this setting, or an empty set (see the table above)."""
    if prox_source == "behav":
        return frozenset({"prox", "behav"})
    if prox_source in ("fused", "separate") and steps_per_batch == 1:
        return frozenset({"prox", "current"})
    return frozenset()


_WHY = {
    "behav": "prox is the behaviour policy (algo.recompute_prox {mode} at async_ratio {r:g})",
    "fused": "prox is the detached current policy (algo.recompute_prox {mode} at async_ratio {r:g})",
    "separate": "prox is recomputed with the weights of the batch's only optimizer step",
}
_FIX = {
    "behav": "set algo.recompute_prox: always",
    "fused": "use a ratio against behav (ppo / gspo: old_policy: behav) or several optimizer steps per batch",
}
_FIX["separate"] = _FIX["fused"]


def ratio_problem(
    who: str,
    ratio: Ratio,
    *,
    prox_source: str,
    mode: str,
    async_ratio: float,
    steps_per_batch: int = 1,
    explicit: bool = False,
) -> str | None:
    """One line saying why ``ratio`` of ``who`` is identically 1 and what to change, or None."""
    if ratio.role != "is" or {ratio.num, ratio.den} != same_policies(prox_source, steps_per_batch):
        return None
    on_policy_form = {ratio.num, ratio.den} == {"prox", "behav"} and async_ratio == 0
    if on_policy_form and not explicit:
        return None
    return (
        f"{who}: its ratio pi_{ratio.num}/pi_{ratio.den} is identically 1 because "
        f"{_WHY[prox_source].format(mode=mode, r=async_ratio)}, so the correction is a no-op; "
        f"{_FIX[prox_source]}"
    )


def mismatch_metrics(behav_logp: torch.Tensor, prox_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, Metric]:
    """How far prox is from behav on the tokens of ``mask`` (all ``[B, T]``): ``mismatch_mean``
    (mean |behav − prox|), ``mismatch_max`` and ``mismatch_kl``, KL(behav‖prox) by the k3
    estimator E[ρ − 1 − log ρ] with log ρ = prox − behav (the tokens come from behav). Means over
    those tokens (weighted by their count when combined); none read when the mask is empty
    (``flash.algos.metrics``)."""
    m = mask.detach()
    log_rho = torch.where(m > 0, (prox_logp - behav_logp).detach(), torch.zeros_like(m))
    n = m.sum()
    return {
        "mismatch_mean": mean(masked_mean(log_rho.abs(), m), n),
        "mismatch_max": maximum(masked_max(log_rho.abs(), m), n),
        "mismatch_kl": mean(masked_mean(torch.expm1(log_rho) - log_rho, m), n),
    }
