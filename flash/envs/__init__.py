"""Environments for agentic, multi-turn RL: the protocol and registry (``base``), a native text
game (``corridor``), a Gymnasium adapter (``gym``), an agentic workload's shape for simulated
runs (``synthetic``), episodes as token sequences (``episode``),
environments as tasks (``task``), and the environment worker actor (``worker``).

A component: imported by ``flash.controllers`` (the episode workflow), ``flash.recipes`` and ``flash.app``;
imports the shared ``flash`` modules and the leaves, never ``flash.recipes``."""

from flash.envs import corridor, gym, synthetic  # noqa: F401  (registers the built-in environments)
from flash.envs.base import (
    Env,
    StepResult,
    env_options,
    make_env,
    register_env,
    registered_envs,
)

__all__ = ["Env", "StepResult", "env_options", "make_env", "register_env", "registered_envs"]
