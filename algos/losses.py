"""Built-in policy losses. Each is a pure function returning per-token terms ``[B, T]``.

Notation: sg = stop-gradient; r_x = exp(logp − x_logp) for x in {prox, behav}; A = advantage.
Masking and aggregation happen once, in ``flash.algos.policy_loss``; the add-ons (KL to a reference,
entropy bonus) are added there too. All metrics are over masked tokens, 0-dim tensors tagged with
how they combine over micro-batches (``flash.algos.metrics``: fractions are means, ``*/max`` a max).

Identity (pinned by the tests): when logp == prox_logp == behav_logp, ``ppo``, ``decoupled_ppo``,
``tis``, ``cispo``, ``topr`` (unit weights) and ``gspo`` all have the gradient of ``vanilla``,
−A·∇logp (their forward values differ: the ratio terms are −A·r, not −A·logp).
"""

from __future__ import annotations

from typing import Literal

import torch

from .aggregate import masked_frac, masked_stats
from .metrics import Metric, mean
from .offpolicy import Ratio
from .policy import LossInputs, register_loss

Out = tuple[torch.Tensor, dict[str, Metric]]
Old = Literal["behav", "prox"]
TO_BEHAV = (Ratio("current", "behav"),)


def _against_old(knobs: dict) -> tuple[Ratio, ...]:
    """ppo's and gspo's one ratio: current over their ``old_policy``."""
    return (Ratio("current", knobs["old_policy"]),)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_clip(k: dict) -> None:
    _require(0 <= k["clip_low"] < 1, f"clip_low must be in [0, 1), got {k['clip_low']}")
    _require(k["clip_high"] >= 0, f"clip_high must be >= 0, got {k['clip_high']}")
    dual = k.get("dual_clip")
    _require(dual is None or dual > 1, f"dual_clip must be None or > 1, got {dual}")
    cap = k.get("behav_cap")
    _require(cap is None or cap > 0, f"behav_cap must be None or > 0, got {cap}")


def clipped_surrogate(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> Out:
    """PPO's per-token term −min(r·A, clip(r, 1−clip_low, 1+clip_high)·A), with the dual clip
    min(·, −c·A) on A < 0 when ``dual_clip`` = c is set. A term counts as clipped (and gets no
    gradient) only when the clipped branch is strictly chosen, so clipping starts exactly at the
    bounds."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    is_clipped = clipped > unclipped
    loss = torch.where(is_clipped, clipped, unclipped)
    metrics = {
        "clipfrac": masked_frac(is_clipped, mask),
        "clipfrac_low": masked_frac(is_clipped & (ratio < 1 - clip_low), mask),
        "clipfrac_high": masked_frac(is_clipped & (ratio > 1 + clip_high), mask),
    }
    if dual_clip is not None:
        bound = -dual_clip * adv
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        metrics["dual_clipfrac"] = masked_frac(dual, mask)
    return loss, metrics


@register_loss("vanilla", "REINFORCE policy gradient: -A·logp (no off-policy correction)", ratios=())
def vanilla(inputs: LossInputs) -> Out:
    """REINFORCE (Williams 1992): −A·logp. No knobs. Off-policy samples are used uncorrected."""
    return -inputs.advantages * inputs.logp, {}


@register_loss(
    "ppo",
    "naive PPO: clipped surrogate on r = exp(logp - old_logp), old = behav "
    "(old_policy: prox for the proximal policy), optional dual clip",
    check=_check_clip,
    ratios=_against_old,
)
def ppo(
    inputs: LossInputs,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    old_policy: Old = "behav",
) -> Out:
    """PPO (Schulman et al., arXiv 1707.06347) with DAPO's asymmetric clip (arXiv 2503.14476):

        r = exp(logp − old_logp);  −min(r·A, clip(r, 1−clip_low, 1+clip_high)·A)

    Naive PPO: the old policy is the one that sampled the tokens, behav (``old_policy: prox``
    takes the proximal policy instead -- then with prox fused into the step r ≡ 1 and the loss
    is REINFORCE, which the config refuses). ``dual_clip`` = c > 1 (Ye et al., arXiv 1912.09729)
    bounds the term at −c·A where A < 0. Defaults: clip_low 0.2, clip_high 0.2, dual_clip None
    (off), old_policy behav.
    """
    old = inputs.behav_logp if old_policy == "behav" else inputs.prox_logp
    ratio = torch.exp(inputs.logp - old)
    return clipped_surrogate(ratio, inputs.advantages, inputs.mask, clip_low, clip_high, dual_clip)


@register_loss(
    "decoupled_ppo",
    "PPO on the proximal policy, weighted by sg(min(pi_prox/pi_behav, behav_cap)) (AReaL)",
    check=_check_clip,
    ratios=(Ratio("prox", "behav"), Ratio("current", "prox", "trust")),
)
def decoupled_ppo(
    inputs: LossInputs,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    behav_cap: float | None = 5.0,
    dual_clip: float | None = None,
) -> Out:
    """Decoupled PPO (AReaL, Fu et al., arXiv 2505.24298; Hilton et al., arXiv 2110.00641):

        w = sg(min(exp(prox_logp − behav_logp), behav_cap));  w · ppo_term(r_prox)

    Equals ``ppo`` when prox_logp == behav_logp (and behav_cap >= 1). Defaults: clip_low 0.2,
    clip_high 0.2, behav_cap 5.0 (None: uncapped), dual_clip None.
    Departure: AReaL's ``behav_imp_weight_cap`` (default: no cap) drops tokens whose weight exceeds
    the cap; flash follows the issue's seed form and clips the weight to the cap instead.
    """
    raw = torch.exp(inputs.prox_logp - inputs.behav_logp).detach()
    w = raw if behav_cap is None else raw.clamp(max=behav_cap)
    ratio = torch.exp(inputs.logp - inputs.prox_logp)
    term, metrics = clipped_surrogate(ratio, inputs.advantages, inputs.mask, clip_low, clip_high, dual_clip)
    metrics.update(masked_stats("is_weight", w, inputs.mask))
    metrics["is_capfrac"] = masked_frac(raw > w, inputs.mask)
    return w * term, metrics


@register_loss(
    "tis",
    "truncated importance sampling: -sg(clip(r_behav, 0, cap))·A·logp",
    check=lambda k: _require(k["cap"] > 0, f"cap must be > 0, got {k['cap']}"),
    ratios=TO_BEHAV,
)
def tis(inputs: LossInputs, *, cap: float = 2.0, level: Literal["token", "sequence"] = "token") -> Out:
    """Truncated importance sampling (Yao et al., "Your efficient RL framework secretly brings you
    off-policy RL training", 2025; Ionides 2008):

        w = sg(clip(exp(logp − behav_logp), 0, cap));  −w·A·logp

    ``level: sequence`` uses one weight per sample from the summed (masked) log-ratio:
    w_i = sg(clip(exp(Σ_t (logp − behav_logp)), 0, cap)). Defaults: cap 2.0, level token.
    Departure: verl and slime multiply the PPO clipped term by the TIS weight; flash implements the
    issue's REINFORCE-style seed form above (combine the weight with PPO via ``decoupled_ppo``).
    """
    log_r = (inputs.logp - inputs.behav_logp).detach()
    if level == "sequence":
        log_r = (log_r * inputs.mask).sum(-1, keepdim=True).expand_as(log_r)
    raw = torch.exp(log_r)
    w = raw.clamp(0, cap)
    metrics = {**masked_stats("is_weight", w, inputs.mask), "is_clipfrac": masked_frac(raw > cap, inputs.mask)}
    return -w * inputs.advantages * inputs.logp, metrics


def _check_cispo(k: dict) -> None:
    _require(
        k["eps_low"] >= 0 and k["eps_high"] >= 0,
        f"eps_low and eps_high must be >= 0, got {k['eps_low']}, {k['eps_high']}",
    )


@register_loss(
    "cispo",
    "clipped IS-weight policy optimisation: -sg(clip(r_behav, 1-eps_low, 1+eps_high))·A·logp",
    check=_check_cispo,
    ratios=TO_BEHAV,
)
def cispo(inputs: LossInputs, *, eps_low: float = 1.0, eps_high: float = 4.0) -> Out:
    """CISPO (MiniMax-M1, arXiv 2506.13585):

        w = sg(clip(exp(logp − behav_logp), 1−eps_low, 1+eps_high));  −w·A·logp

    Every token keeps a gradient; only its weight is clipped. Defaults: eps_low 1.0 (no lower
    bound, as MiniMax-M1 does), eps_high 4.0 (flash's choice: the paper tunes only eps_high and
    gives no value; ScaleRL, arXiv 2510.13786, also truncates at a large upper bound).
    """
    raw = torch.exp(inputs.logp - inputs.behav_logp).detach()
    w = raw.clamp(1 - eps_low, 1 + eps_high)
    m = inputs.mask
    metrics = {
        **masked_stats("is_weight", w, m),
        "clipfrac_low": masked_frac(raw < 1 - eps_low, m),
        "clipfrac_high": masked_frac(raw > 1 + eps_high, m),
    }
    metrics["clipfrac"] = mean(metrics["clipfrac_low"].value + metrics["clipfrac_high"].value)
    return -w * inputs.advantages * inputs.logp, metrics


def _check_topr(k: dict) -> None:
    _require(
        k["positive_weight"] >= 0 and k["negative_weight"] >= 0,
        f"positive_weight and negative_weight must be >= 0, got {k['positive_weight']}, {k['negative_weight']}",
    )


@register_loss(
    "topr",
    "tapered off-policy REINFORCE: reward > threshold -w+·A·logp, else "
    "-w-·sg(min(pi/mu, 1))·A·logp, pi/mu per trajectory (level: token per token)",
    check=_check_topr,
    ratios=TO_BEHAV,
)
def topr(
    inputs: LossInputs,
    *,
    threshold: float = 0.0,
    positive_weight: float = 1.0,
    negative_weight: float = 1.0,
    level: Literal["sequence", "token"] = "sequence",
) -> Out:
    """TOPR (Le Roux et al., "Tapered Off-Policy REINFORCE", arXiv 2503.14286). The sign split is
    on the reward, not the advantage: a sample is positive when reward > ``threshold``.

        positive:  −positive_weight · A · logp                 (SFT-like: no ratio, no truncation)
        negative:  −negative_weight · sg(min(ρ, 1)) · A · logp

    ``level: sequence`` (default, the paper's): ρ_i = π(y_i)/μ(y_i) = exp(Σ_t (logp − behav_logp))
    over the sample's masked tokens, one truncated weight for the whole trajectory.
    ``level: token``: ρ_t = exp(logp_t − behav_logp_t) per token (a lower-variance variant the
    paper does not use). μ is the behaviour policy. Needs ``inputs.rewards``.
    Departure: the paper multiplies by the reward R(τ) (with an optional baseline); flash uses the
    configured advantage A, which is R − baseline for a REINFORCE-style estimator.
    """
    rewards = inputs.require("rewards", "loss 'topr'")
    m = inputs.mask
    positive = (rewards > threshold)[:, None].expand_as(inputs.logp)
    log_rho = ((inputs.logp - inputs.behav_logp) * m).detach()
    if level == "sequence":
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(log_rho)
    neg_w = log_rho.exp().clamp(max=1.0)
    w = torch.where(positive, torch.full_like(neg_w, positive_weight), negative_weight * neg_w)
    metrics = {
        "positive_frac": mean((rewards > threshold).float().mean() if len(rewards) else 0.0),
        **masked_stats("is_weight", w, m * ~positive),
        "is_clipfrac": masked_frac(log_rho > 0, m * ~positive),
    }
    return -w * inputs.advantages * inputs.logp, metrics


@register_loss(
    "gspo",
    "group sequence policy optimisation: PPO clip on the per-sample ratio "
    "exp(mean_t(logp - old_logp)), old = behav (old_policy: prox)",
    check=_check_clip,
    ratios=_against_old,
)
def gspo(inputs: LossInputs, *, clip_low: float = 3e-4, clip_high: float = 4e-4, old_policy: Old = "behav") -> Out:
    """GSPO (Zheng et al., arXiv 2507.18071), in its GSPO-token form:

        s_i = exp( Σ_t m·(logp − old_logp) / Σ_t m )            (per-sample ratio)
        s_it = sg(s_i) · exp(logp_t − sg(logp_t))                (value s_i, gradient s_i·∇logp_t)
        −min(s_it·A, clip(s_it, 1−clip_low, 1+clip_high)·A)

    With ``agg: seq-mean-token-mean`` and per-sample advantages this is exactly the paper's
    sequence objective and gradient; other aggregations weight samples differently.
    The old policy is behav, as in ``ppo`` (``old_policy: prox`` for the proximal one).
    Defaults: clip_low 3e-4, clip_high 4e-4 (the paper's ranges), old_policy behav.
    """
    m = inputs.mask
    old = inputs.behav_logp if old_policy == "behav" else inputs.prox_logp
    with torch.no_grad():
        seq_log_ratio = ((inputs.logp - old) * m).sum(-1) / m.sum(-1).clamp_min(1)
        s = seq_log_ratio.exp()
    s_tok = s[:, None] * torch.exp(inputs.logp - inputs.logp.detach())
    loss, metrics = clipped_surrogate(s_tok, inputs.advantages, m, clip_low, clip_high)
    has_tokens = m.sum(-1) > 0
    metrics.update(masked_stats("seq_ratio", s, has_tokens))
    return loss, metrics
