"""Rewards: the code sandbox, the adaptive sandbox timeout, reward functions by name, and the
reward workers (Ray actors) with the ``RewardPool`` client the rollout scheduler calls.

``flash.rewards.sandbox`` and the registry import without Ray; ``RewardPool`` and
``RewardResult`` load ``flash.rewards.workers`` (and Ray) on first use. A component: imported by
``flash.recipes`` and ``flash.app``; imports ``flash.engine`` (the judge's engine), the shared ``flash``
modules and the leaves.
"""

from flash.rewards.registry import (
    build_reward,
    register_reward,
    registered_rewards,
    validate_reward,
)

__all__ = [
    "RewardPool",
    "RewardResult",
    "build_reward",
    "register_reward",
    "registered_rewards",
    "validate_reward",
]


def __getattr__(name: str):
    if name in ("RewardPool", "RewardResult"):
        from flash.rewards import workers

        return getattr(workers, name)
    raise AttributeError(f"module 'flash.rewards' has no attribute {name!r}")
