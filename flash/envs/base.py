"""The environment protocol (docs/design.md) and its registry.

An environment is a text game the policy plays turn by turn::

    reset(seed) -> observation
    step(action) -> (observation, reward, done, info)

Observations and actions are text, so the tokenizer, the engines and the trainer never see an
environment's internals and an episode is an ordinary token sequence (``flash.envs.episode``).
``reset`` is deterministic in ``seed``: the same seed gives the same start and, with the same
actions, the same observations -- replaying a transcript must reproduce it (the tests rely on it).

``info["outcome"]`` names how a finished episode ended (``success``, ``invalid_action``, ...): the
episode scheduler counts episodes per outcome, so no way of ending is silent. An action the game
does not know ends the episode with reward 0 and outcome ``invalid_action`` rather than raising:
a policy's bad output is data, not a crash.

An environment class declares ``Options`` (a dataclass of its knobs), ``actions`` (the valid
action strings) and ``action_tokens`` (the longest action in tokens of the tiny byte tokenizer);
``expert_action()`` (optional) is the demonstration policy the SFT warm start imitates.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

from flash.algos.registry import Registry


class StepResult(NamedTuple):
    """What ``step`` returns; a plain tuple ``(observation, reward, done, info)`` as well."""

    observation: str
    reward: float
    done: bool
    info: dict


@runtime_checkable
class Env(Protocol):
    actions: tuple[str, ...]
    action_tokens: int

    def reset(self, seed: int) -> str: ...

    def step(self, action: str) -> StepResult: ...


# The built-in environments register when their modules are imported (``flash.envs`` imports
# them); named here too so that a lookup through this module alone finds them.
ENVS = Registry("environment", builtins=("flash.envs.corridor", "flash.envs.gym", "flash.envs.synthetic"))


def register_env(name: str) -> Callable[[type], type]:
    """Class decorator: ``@register_env("corridor")`` makes the class available to ``make_env``."""

    def wrap(cls: type) -> type:
        missing = [m for m in ("reset", "step", "actions", "action_tokens") if not hasattr(cls, m)]
        if missing:
            raise TypeError(f"environment {cls.__name__} lacks {missing} (see flash.envs.base.Env)")
        if not dataclasses.is_dataclass(getattr(cls, "Options", None)):
            raise TypeError(f"{cls.__name__}.Options must be a dataclass of its knobs")
        ENVS.register(name, (inspect.getdoc(cls) or "").split("\n")[0])(cls)
        cls.env_name = name
        return cls

    return wrap


def registered_envs() -> list[str]:
    return ENVS.names()


def env_options(name: str) -> type:
    """The options dataclass of environment ``name``."""
    return ENVS.get(name).fn.Options


def make_env(name: str, **options: Any) -> Env:
    """Build environment ``name``; an unknown option raises the closest-name error."""
    cls = ENVS.check_knobs(name, options, what="option").fn
    return cls(cls.Options(**options))


def invalid_action(observation: str, action: str, actions: tuple[str, ...]) -> StepResult:
    """The step result of an action the game does not know: the episode ends, reward 0."""
    return StepResult(observation, 0.0, True, {"outcome": "invalid_action", "action": action, "valid": list(actions)})
