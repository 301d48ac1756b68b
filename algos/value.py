"""The critic's objective: a clipped value regression (PPO, Schulman et al. 2017, as in verl/OpenRLHF).

``value_loss`` is a pure function over ``[batch, tokens]`` tensors, like the policy losses:

    V_clip = V_old + clip(V − V_old, −ε, ε)
    L      = ½ · max((V − R)², (V_clip − R)²)      aggregated as a token mean over ``mask``

``V_old`` are the values the advantages were computed with (the critic before this step), ``R``
the GAE returns (advantages + V_old). The clip keeps one step from moving a value further than
``ε`` from where the advantages assumed it was; ``clip=None`` gives the plain squared error.
"""

from __future__ import annotations

import torch

from .aggregate import masked_mean


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float | None = 0.2
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss (token mean over ``mask``) and its metrics (clip fraction, explained variance)."""
    old_values, returns, mask = old_values.detach(), returns.detach(), mask.detach().to(values.dtype)
    err = (values - returns) ** 2
    if clip is None:
        per_token, clipped = err, torch.zeros_like(err)
    else:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        err_clip = (v_clip - returns) ** 2
        per_token, clipped = torch.maximum(err, err_clip), (err_clip > err).to(values.dtype)
    loss = 0.5 * masked_mean(per_token, mask)
    with torch.no_grad():
        resid = masked_mean((returns - values) ** 2, mask)
        var = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
        metrics = {
            "critic/value_loss": float(loss),
            "critic/clipfrac": float(masked_mean(clipped, mask)),
            "critic/explained_var": float(1 - resid / var) if float(var) > 0 else 0.0,
            "critic/values_mean": float(masked_mean(values, mask)),
        }
    return loss, metrics
