"""``LossInputs``: what every loss and every correction sees (its own module so that losses,
corrections and the one caller, ``flash.algos.policy``, import it without a cycle)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

_TOKEN_FIELDS = ("logp", "prox_logp", "behav_logp", "advantages", "mask")


@dataclass
class LossInputs:
    """What every loss sees. ``[B, T]`` float tensors unless noted; ``mask`` is 1 on the response
    tokens that count. ``advantages`` may be given per sample (``[B]``); it is then broadcast
    over tokens.

    - ``logp``: the policy being optimised (carries gradient).
    - ``prox_logp``: the proximal policy (trainer weights at the start of the step); equal to
      ``behav_logp`` when not recomputed.
    - ``behav_logp``: the behaviour policy that generated the tokens (engine logprobs).
    - ``rewards`` ``[B]``, ``versions`` ``[B, T]``, ``ref_logp`` ``[B, T]`` (KL add-on),
      ``entropy`` ``[B, T]`` (entropy bonus): optional; a loss that needs a missing one says so.
    """

    logp: torch.Tensor
    prox_logp: torch.Tensor
    behav_logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    rewards: torch.Tensor | None = None
    versions: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    entropy: torch.Tensor | None = None

    def __post_init__(self) -> None:
        shape = tuple(self.logp.shape)
        if len(shape) != 2:
            raise ValueError(f"LossInputs.logp must be [batch, tokens], got {list(shape)}")
        if self.advantages.dim() == 1:
            self.advantages = self.advantages[:, None].expand(shape)
        for name in (*_TOKEN_FIELDS, "versions", "ref_logp", "entropy"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(f"LossInputs.{name} has shape {list(value.shape)}, expected {list(shape)} like logp")
        if self.rewards is not None and tuple(self.rewards.shape) != shape[:1]:
            raise ValueError(f"LossInputs.rewards must be [batch]={[shape[0]]}, got {list(self.rewards.shape)}")

    def require(self, name: str, who: str) -> torch.Tensor:
        """``getattr(self, name)``, or a ``ValueError`` saying that ``who`` needs it."""
        value = getattr(self, name)
        if value is None:
            raise ValueError(
                f"{who} needs LossInputs.{name}, which is None; pass it when "
                f"building LossInputs (fields: {[f.name for f in fields(self)]})"
            )
        return value
