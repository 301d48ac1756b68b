"""Environments for agentic, multi-turn RL: the protocol and registry, a native text game,
a Gymnasium adapter, episodes as token sequences, and the environment worker actor."""

from flash.envs import corridor, gym  # noqa: F401  (registers the built-in environments)
from flash.envs.base import (
    Env,
    StepResult,
    env_options,
    make_env,
    register_env,
    registered_envs,
)

__all__ = ["Env", "StepResult", "env_options", "make_env", "register_env", "registered_envs"]
