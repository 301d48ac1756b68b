"""``synthetic``: an agentic workload's *shape* with no game in it -- turns, observations, outcome.

The simulated engine (``rollout.engine: sim``) writes synthetic token ids, so no real game can
read its actions; what a simulated agentic run needs from an environment is only what costs time
on a cluster: how many turns an episode lasts, how many tokens each observation adds to the
context, and (through the workers' ``task.step_delay_s``) how long each environment step takes.
This environment accepts any action and draws all of it from the episode's seed:

    turns     uniform in ``[turns_min, turns_max]`` (agentic benchmarks run from a few turns
              to tens of them; ROLL-Flash's ALFWorld/SWE-style tasks are multi-turn)
    each step an observation of ``obs_chars`` characters (tokens of the tiny byte tokenizer;
              ``sim.token_scale`` simulated tokens each), reward 0
    last step reward 1 with probability ``success_rate`` (outcome ``success``, else ``failure``)

Replaying an episode from its seed gives the same turns, observations and outcome, whatever the
actions (``flash.envs.base``'s determinism contract).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from flash.envs.base import StepResult, register_env

OBS_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"


@dataclass(frozen=True)
class SyntheticOptions:
    turns_min: int = 2  # environment steps per episode, uniform between these
    turns_max: int = 6
    obs_chars: int = 8  # characters of each observation
    action_tokens: int = 8  # token ids of one LLM turn (rollout.max_new_tokens must equal it)
    success_rate: float = 0.5  # probability an episode ends with reward 1

    def __post_init__(self) -> None:
        if not 1 <= self.turns_min <= self.turns_max:
            raise ValueError(f"need 1 <= turns_min <= turns_max, got {self.turns_min} and {self.turns_max}")
        if self.obs_chars < 1 or self.action_tokens < 1:
            raise ValueError(f"obs_chars and action_tokens must be >= 1, got {self.obs_chars} and {self.action_tokens}")
        if not 0.0 <= self.success_rate <= 1.0:
            raise ValueError(f"success_rate must be in [0, 1], got {self.success_rate}")


@register_env("synthetic")
class Synthetic:
    """Any action is taken; turns, observations and the outcome come from the seed (see the module doc)."""

    Options = SyntheticOptions
    actions = ("a",)  # what a demonstration would play; every action is accepted
    action_tokens = SyntheticOptions.action_tokens

    def __init__(self, options: SyntheticOptions = SyntheticOptions()):
        self.options = options
        self.action_tokens = options.action_tokens
        self.rng = random.Random(0)
        self.turns = self.steps = 0
        self.done = True

    def reset(self, seed: int) -> str:
        o = self.options
        self.rng = random.Random(seed)
        self.turns, self.steps, self.done = self.rng.randint(o.turns_min, o.turns_max), 0, False
        return self._observation()

    def step(self, action: str) -> StepResult:
        if self.done:
            raise RuntimeError("step() on a finished synthetic episode; call reset(seed) first")
        self.steps += 1
        obs = self._observation()
        if self.steps < self.turns:
            return StepResult(obs, 0.0, False, {})
        self.done = True
        won = self.rng.random() < self.options.success_rate
        return StepResult(obs, 1.0 if won else 0.0, True, {"outcome": "success" if won else "failure"})

    def expert_action(self) -> str:
        return self.actions[0]

    def _observation(self) -> str:
        return "".join(self.rng.choice(OBS_CHARS) for _ in range(self.options.obs_chars)) + ":"
