"""Advantage estimators: a registry of pure functions, and ``compute_advantages`` (the one caller).

An estimator is ``fn(inputs: AdvantageInputs, *, knob=default, ...) -> advantages [B, T]``.
``compute_advantages`` checks the knobs, calls it, then applies the add-ons every estimator takes,
in this order, and zeroes masked-out tokens:

- ``whiten`` (default False): (A − mean) / (std + 1e-8) over the masked tokens of the batch;
  the std is the population one, or with ``whiten_unbiased`` (default False) the Bessel-corrected
  one (n − 1, as verl, ROLL and AReaL).
- ``clip`` (default None: off): clamp A to [−clip, clip].

Groups: ``group_ids[i]`` names the prompt sample ``i`` answers (``Sample.group_id``); samples of
one prompt share it. A group of one sample gets advantage 0 from every group-baseline estimator.

Precision: group statistics and whitening are computed in float64 on rewards shifted by each
group's first reward, then cast to the rewards' dtype, so a group whose rewards are all equal (0.7,
2/3, 0.1, not exact in binary) gets advantage exactly 0 in any dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .aggregate import masked_mean
from .registry import Registry

ADV_ADDON_KNOBS: dict[str, Any] = {"clip": None, "whiten": False, "whiten_unbiased": False}
_ADDON_HINTS = {"clip": float | None, "whiten": bool, "whiten_unbiased": bool}
ADVANTAGES = Registry("advantage estimator", "flash.advantages", reserved=ADV_ADDON_KNOBS)


@dataclass
class AdvantageInputs:
    """``rewards`` ``[B]`` (gae also takes token-level ``[B, T]``), ``group_ids`` ``[B]`` (long),
    ``mask`` ``[B, T]`` float, ``values`` ``[B, T]`` (the critic's V(s_t); gae only)."""

    rewards: torch.Tensor
    group_ids: torch.Tensor
    mask: torch.Tensor
    values: torch.Tensor | None = None


def register_advantage(
    name: str, description: str | None = None, *, check: Callable[[dict], None] | None = None, aliases=()
) -> Callable:
    """Decorator registering ``fn(inputs: AdvantageInputs, *, knob=default) -> [B, T]``."""
    return ADVANTAGES.register(name, description, check=check, aliases=aliases)


def _resolve(name: str, knobs: dict[str, Any]):
    entry, full = ADVANTAGES.resolve(name, knobs, ADV_ADDON_KNOBS, _ADDON_HINTS)
    if full["clip"] is not None and not full["clip"] > 0:
        raise ValueError(f"advantage clip must be None or > 0, got {full['clip']}")
    if full["whiten_unbiased"] and not full["whiten"]:
        raise ValueError("advantage whiten_unbiased chooses the std of whiten: set whiten: true with it, or drop it")
    return entry, full


def validate_advantage(name: str, knobs: dict[str, Any] | None = None) -> None:
    """Raise ``ValueError`` unless ``compute_advantages(name, ..., **knobs)`` would accept them."""
    _resolve(name, dict(knobs or {}))


def describe_advantages() -> list[dict[str, Any]]:
    """``[{name, description, knobs: {knob: default}, aliases}]``; knobs include clip/whiten."""
    rows = ADVANTAGES.describe()
    for row in rows:
        row["knobs"].update(ADV_ADDON_KNOBS)
    return rows


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, unbiased: bool = False) -> torch.Tensor:
    """(x − mean) / (std + eps) with mean and std over ``mask`` (population std, or the
    Bessel-corrected one with ``unbiased``; 0 with one masked token), in float64, cast back."""
    x64, m64 = x.double(), mask.double()
    n = m64.sum()
    mean = (x64 * m64).sum() / n.clamp_min(1)
    sq = ((x64 - mean).square() * m64).sum()
    std = (sq / (n - 1 if unbiased else n).clamp_min(1)).sqrt()
    return ((x64 - mean) / (std + eps)).to(x.dtype)


def compute_advantages(
    name: str,
    rewards: torch.Tensor | Sequence[float],
    group_ids: torch.Tensor | Sequence[int],
    mask: torch.Tensor,
    values: torch.Tensor | None = None,
    **knobs: Any,
) -> torch.Tensor:
    """Advantages ``[B, T]`` (0 on masked-out tokens, no gradient) from estimator ``name``."""
    entry, full = _resolve(name, knobs)
    mask = mask.detach()
    dtype = mask.dtype if mask.is_floating_point() else torch.float32
    mask = mask.to(dtype)
    inputs = AdvantageInputs(
        torch.as_tensor(rewards, dtype=dtype).detach(),
        torch.as_tensor(group_ids, dtype=torch.long),
        mask,
        None if values is None else values.detach().to(dtype),
    )
    _check_shapes(inputs)
    with torch.no_grad():
        adv = entry.fn(inputs, **{k: full[k] for k in entry.knobs})
        if tuple(adv.shape) != tuple(mask.shape):
            raise ValueError(f"estimator {name!r} returned shape {list(adv.shape)}, expected {list(mask.shape)}")
        if full["whiten"]:
            adv = masked_whiten(adv, mask, unbiased=full["whiten_unbiased"])
        if full["clip"] is not None:
            adv = adv.clamp(-full["clip"], full["clip"])
    return adv * mask


def _check_shapes(x: AdvantageInputs) -> None:
    if x.mask.dim() != 2:
        raise ValueError(f"mask must be [batch, tokens], got {list(x.mask.shape)}")
    batch = x.mask.shape[0]
    if tuple(x.rewards.shape) not in ((batch,), tuple(x.mask.shape)):
        raise ValueError(f"rewards must be [batch]={[batch]} (gae: or [batch, tokens]), got {list(x.rewards.shape)}")
    if tuple(x.group_ids.shape) != (batch,):
        raise ValueError(f"group_ids must be [batch]={[batch]}, got {list(x.group_ids.shape)}")
    if x.values is not None and x.values.shape != x.mask.shape:
        raise ValueError(f"values must be {list(x.mask.shape)}, got {list(x.values.shape)}")


def _sample_rewards(inputs: AdvantageInputs, who: str) -> torch.Tensor:
    if inputs.rewards.dim() != 1:
        raise ValueError(f"{who} takes one reward per sample ([batch]); token-level rewards are for 'gae'")
    return inputs.rewards


@dataclass
class GroupStats:
    """Per sample, in float64: ``centred`` = r − its group's mean, the group's unbiased ``std``
    (0 for a group of one) and ``count`` (its size)."""

    centred: torch.Tensor
    std: torch.Tensor
    count: torch.Tensor


def group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> GroupStats:
    """Group statistics in float64 on rewards shifted by their group's first reward: a group of
    equal rewards has ``centred`` and ``std`` exactly 0 whatever the rewards' dtype."""
    _, inv = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    r = rewards.double()
    first = torch.full((n_groups,), r.numel(), dtype=torch.long)
    first = first.scatter_reduce(0, inv, torch.arange(r.numel()), reduce="amin")
    shifted = r - r[first][inv]
    zeros = r.new_zeros(n_groups)
    count = zeros.index_add(0, inv, torch.ones_like(r))
    centred = shifted - (zeros.index_add(0, inv, shifted) / count)[inv]
    sq = zeros.index_add(0, inv, centred.square())
    std = (sq / (count - 1).clamp_min(1)).sqrt()
    return GroupStats(centred, std[inv], count[inv])


def _per_token(per_sample: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return per_sample[:, None] * mask


def _check_eps(k: dict) -> None:
    if not k["eps"] >= 0:
        raise ValueError(f"eps must be >= 0, got {k['eps']}")


@register_advantage("grpo", "group-normalised reward: (r - mean_g) / (std_g + eps)", check=_check_eps)
def grpo(inputs: AdvantageInputs, *, eps: float = 1e-6) -> torch.Tensor:
    """GRPO (Shao et al., arXiv 2402.03300): A_i = (r_i − mean_g) / (std_g + eps), the same for
    every token of sample i. std_g is the unbiased (n−1) std, as in verl and TRL; a group whose
    rewards are all equal (std 0) gets A = 0. Default: eps 1e-6."""
    r = _sample_rewards(inputs, "grpo")
    g = group_stats(r, inputs.group_ids)
    return _per_token((g.centred / (g.std + eps)).to(r.dtype), inputs.mask)


@register_advantage("dr_grpo", "group-centred reward: r - mean_g (no std)")
def dr_grpo(inputs: AdvantageInputs) -> torch.Tensor:
    """Dr. GRPO (Liu et al., arXiv 2503.20783): A_i = r_i − mean_g; no std division (pair it
    with ``agg: seq-mean-token-sum-norm``). No knobs."""
    r = _sample_rewards(inputs, "dr_grpo")
    return _per_token(group_stats(r, inputs.group_ids).centred.to(r.dtype), inputs.mask)


@register_advantage("rloo", "leave-one-out baseline: r_i - mean of the other samples' rewards")
def rloo(inputs: AdvantageInputs) -> torch.Tensor:
    """RLOO (Kool et al. 2019; Ahmadian et al., arXiv 2402.14740):
    A_i = r_i − (1/(n−1)) Σ_{j≠i} r_j = n/(n−1)·(r_i − mean_g); 0 for a group of one. No knobs."""
    r = _sample_rewards(inputs, "rloo")
    g = group_stats(r, inputs.group_ids)
    n = g.count
    scale = torch.where(n > 1, n / (n - 1).clamp_min(1), torch.zeros_like(n))
    return _per_token((scale * g.centred).to(r.dtype), inputs.mask)


def _check_reinforce_pp(k: dict) -> None:
    _check_eps(k)
    if not 0 <= k["gamma"] <= 1:
        raise ValueError(f"gamma must be in [0, 1], got {k['gamma']}")


@register_advantage(
    "reinforce_pp",
    "REINFORCE++: discounted return, normalised over the batch",
    aliases=("reinforce++",),
    check=_check_reinforce_pp,
)
def reinforce_pp(
    inputs: AdvantageInputs, *, gamma: float = 1.0, eps: float = 1e-6, group_baseline: bool = False
) -> torch.Tensor:
    """REINFORCE++ (Hu, arXiv 2501.03262). The reward sits on the last masked token; the return
    of token t is G_t = gamma^k_t · r (k_t = masked tokens after t); then
    A = (G − mean) / (std + eps) over all masked tokens of the batch (population std).
    ``group_baseline`` (REINFORCE++-baseline) first subtracts the group mean reward.
    Defaults: gamma 1.0, eps 1e-6, group_baseline False.
    Departure: the paper folds a per-token KL penalty into the reward; in flash the KL to the
    reference policy is the loss add-on ``kl_coef``.
    """
    r = _sample_rewards(inputs, "reinforce_pp")
    if group_baseline:
        r = group_stats(r, inputs.group_ids).centred.to(r.dtype)
    m = inputs.mask
    after = m.flip(-1).cumsum(-1).flip(-1) - m  # masked tokens after t
    returns = r[:, None] * torch.pow(torch.as_tensor(gamma, dtype=m.dtype), after) * m
    mean = masked_mean(returns, m)
    std = masked_mean((returns - mean).square(), m).sqrt()
    return (returns - mean) / (std + eps) * m


def gae_advantages_and_returns(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over ``[B, T]``; masked-out positions are skipped (the chain links masked tokens), and
    V after the last token is 0. Returns (advantages, returns = advantages + values), 0 off-mask;
    the critic regresses on ``returns``."""
    adv = torch.zeros_like(values)
    next_value = values.new_zeros(values.shape[0])
    last_gae = values.new_zeros(values.shape[0])
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        adv[:, t] = gae_t * m
        last_gae = torch.where(m > 0, gae_t, last_gae)
        next_value = torch.where(m > 0, values[:, t], next_value)
    return adv, (adv + values) * mask


def _check_gae(k: dict) -> None:
    if not (0 <= k["gamma"] <= 1 and 0 <= k["lam"] <= 1):
        raise ValueError(f"gamma and lam must be in [0, 1], got {k['gamma']}, {k['lam']}")


@register_advantage("gae", "generalised advantage estimation with a critic's values", check=_check_gae)
def gae(inputs: AdvantageInputs, *, gamma: float = 1.0, lam: float = 1.0) -> torch.Tensor:
    """GAE (Schulman et al., arXiv 1506.02438): δ_t = r_t + γ·V_{t+1} − V_t,
    A_t = Σ_l (γλ)^l δ_{t+l}. A sample's reward ``[B]`` sits on its last masked token (or pass
    token-level rewards ``[B, T]``). Needs ``values``. Defaults: gamma 1.0, lam 1.0 (verl's PPO
    defaults for LLMs; InstructGPT-style)."""
    if inputs.values is None:
        raise ValueError(
            "estimator 'gae' needs values [batch, tokens] from a critic; pass compute_advantages(..., values=...)"
        )
    token_rewards = _token_rewards(inputs.rewards, inputs.mask)
    return gae_advantages_and_returns(token_rewards, inputs.values, inputs.mask, gamma, lam)[0]


def _token_rewards(rewards: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` rewards: given per token, or a sample's reward on its last masked token."""
    if rewards.dim() == 2:
        return rewards * m
    last = (m.flip(-1).cumsum(-1).flip(-1) == 1) & (m > 0)
    return rewards[:, None] * last.to(m.dtype)


def gae_returns(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> torch.Tensor:
    """The critic's regression targets for ``gae``: raw GAE advantages + values (before any
    ``whiten``/``clip`` of the policy's advantages, which must not move the value targets)."""
    mask = mask.detach().to(values.dtype)
    rewards = torch.as_tensor(rewards, dtype=values.dtype)
    with torch.no_grad():
        return gae_advantages_and_returns(_token_rewards(rewards, mask), values.detach(), mask, gamma, lam)[1]
