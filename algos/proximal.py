"""The approximate proximal policy (AReaL's ``loglinear`` proximal log-probability approximation).

Decoupled PPO needs log π_prox on every token; recomputing it costs a forward pass. AReaL
(inclusionAI/AReaL, ``compute_prox_logp_approximations``; docs "Proximal Log-Probability
Approximation") interpolates it per token, by version, between the behaviour logprob the engine
reported and the current policy's logprob from the training forward:

    v_prox = t − 1,  v_θ = t,  v_b = the token's version
    α = clamp((v_prox − v_b) / (v_θ − v_b), 0, 1)      (α = 0 where v_θ − v_b ≤ 0)
    log π_prox ≈ log π_b + α · (log π_θ − log π_b)

with ``t`` the trainer's version (the number of weight updates so far; flash and AReaL count
versions the same way). So a token from version t or t − 1 keeps its behaviour logprob, one from
t − 2 sits half-way to the current policy, one from t − k at (k − 1)/k of the way.

Departure: none in the formula; it is AReaL's, kept exactly so that numbers compare. Note what it
assumes: that the policy moves evenly, one version per update, with π_θ one version past π_prox.
In flash the first optimizer step of a batch runs on the proximal weights themselves (so the fused
recompute is exact there); ``algo.measure_prox_error`` reports how far the approximation is from
the real recompute (``rollout/prox_approx_error``).
"""

from __future__ import annotations

import torch


def approx_prox_logp(
    behav_logp: torch.Tensor, logp: torch.Tensor, versions: torch.Tensor, version: int
) -> torch.Tensor:
    """Log-linear interpolation of the proximal logprobs (formula above); all ``[B, T]``, ``logp``
    detached by the caller. Tokens with a negative version (none generated) keep ``behav_logp``."""
    v_b = versions.to(behav_logp.dtype)
    diff = float(version) - v_b
    gap = float(version - 1) - v_b
    ok = (diff > 0) & (versions >= 0)
    alpha = torch.where(ok, gap / torch.where(ok, diff, torch.ones_like(diff)), torch.zeros_like(v_b))
    alpha = alpha.clamp(0.0, 1.0)
    return behav_logp + alpha * (logp - behav_logp)


def prox_approx_error(
    behav_logp: torch.Tensor, recomputed: torch.Tensor, versions: torch.Tensor, mask: torch.Tensor, version: int
) -> float:
    """Mean |approx − recomputed| over masked tokens, the approximation taken with the current
    policy at the start of the batch (= ``recomputed``, the proximal weights themselves)."""
    approx = approx_prox_logp(behav_logp, recomputed, versions, version)
    n = float(mask.sum())
    return float(((approx - recomputed).abs() * mask).sum()) / n if n > 0 else 0.0
