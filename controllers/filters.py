"""Dynamic sampling (DAPO): rules that drop a finished group before it reaches the buffer.

A GRPO-style advantage is ``reward - mean(group)``: a group whose ``n`` rewards are all equal has
zero advantage on every token, so training on it spends compute and shrinks the effective batch
(DAPO §3.2). ``filter_reason`` names the first rule a group breaks, in a fixed order, so that every
filtered group is counted under exactly one rule (``rollout/filtered/<rule>``, a ledger line with
the rule). The scheduler frees the group's admission slot (``flash.controllers.provisioning``) so the
batch is filled by another prompt rather than trained short.

Rules (each off by default; several may be on):

- ``all_same_reward``: every reward in the group is equal;
- ``reward_std``: the population standard deviation of the rewards is below ``min_reward_std``;
- ``length``: some response is longer than ``max_response_len`` tokens (DAPO's overlong filter at
  group level: a truncated response's reward says little about the prompt).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RULES = ("all_same_reward", "reward_std", "length")


@dataclass
class FilterConfig:
    all_same_reward: bool = False  # drop groups whose n rewards are all equal (zero advantage)
    min_reward_std: float = 0.0  # drop groups whose reward std is below this; 0 = off
    max_response_len: int = 0  # drop groups with a response longer than this (tokens); 0 = off

    @property
    def enabled(self) -> bool:
        return self.all_same_reward or self.min_reward_std > 0 or self.max_response_len > 0

    @property
    def reads_rewards(self) -> bool:
        return self.all_same_reward or self.min_reward_std > 0


def reward_std(rewards: list[float]) -> float:
    """Population standard deviation (the spread GRPO normalises by)."""
    mean = sum(rewards) / len(rewards)
    return math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))


def filter_reason(rewards: list[float], lengths: list[int], cfg: FilterConfig) -> str | None:
    """The first rule (in ``RULES`` order) the group breaks, or None to keep it."""
    if not rewards:
        raise ValueError("filter_reason needs a non-empty group")
    if cfg.all_same_reward and all(r == rewards[0] for r in rewards):
        return "all_same_reward"
    if cfg.min_reward_std > 0 and reward_std(rewards) < cfg.min_reward_std:
        return "reward_std"
    if cfg.max_response_len > 0 and max(lengths) > cfg.max_response_len:
        return "length"
    return None


def check_filter(cfg: FilterConfig, n: int, max_new_tokens: int) -> str | None:
    """A message naming the fix for a filter setting that cannot work, or None."""
    if cfg.min_reward_std < 0 or not math.isfinite(cfg.min_reward_std):
        return f"rollout.filter.min_reward_std must be a finite number >= 0, got {cfg.min_reward_std}"
    if cfg.max_response_len < 0:
        return f"rollout.filter.max_response_len must be >= 0 (0 = off), got {cfg.max_response_len}"
    if cfg.max_response_len >= max_new_tokens:
        return (
            f"rollout.filter.max_response_len ({cfg.max_response_len}) >= rollout.max_new_tokens "
            f"({max_new_tokens}): no response can be longer, the rule never fires; lower it or set 0"
        )
    if cfg.reads_rewards and n < 2:
        return (
            "rollout.filter.all_same_reward / min_reward_std need rollout.n >= 2: a group of one "
            "response always has equal rewards and every group would be filtered"
        )
    return None
