"""The environment protocol (DESIGN.md) and its registry.

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
action strings) and ``action_tokens`` (the longest action in tokens of the character tokenizer);
``expert_action()`` (optional) is the demonstration policy the SFT warm start imitates.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable


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


_REGISTRY: dict[str, type] = {}


def register_env(name: str) -> Callable[[type], type]:
    """Class decorator: ``@register_env("corridor")`` makes the class available to ``make_env``."""

    def wrap(cls: type) -> type:
        missing = [m for m in ("reset", "step", "actions", "action_tokens") if not hasattr(cls, m)]
        if missing:
            raise TypeError(f"environment {cls.__name__} lacks {missing} (see flash.envs.base.Env)")
        if not dataclasses.is_dataclass(getattr(cls, "Options", None)):
            raise TypeError(f"{cls.__name__}.Options must be a dataclass of its knobs")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"environment {name!r} is already registered by {_REGISTRY[name].__name__}")
        _REGISTRY[name] = cls
        cls.env_name = name
        return cls

    return wrap


def registered_envs() -> list[str]:
    return sorted(_REGISTRY)


def _lookup(name: str) -> type:
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown environment {name!r}{hint} (registered: {registered_envs()})")
    return _REGISTRY[name]


def env_options(name: str) -> type:
    """The options dataclass of environment ``name``."""
    return _lookup(name).Options


def make_env(name: str, **options: Any) -> Env:
    """Build environment ``name``; an unknown option raises ValueError naming the closest one."""
    cls = _lookup(name)
    valid = [f.name for f in dataclasses.fields(cls.Options)]
    for key in options:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown option {key!r} for environment {name!r}{hint} (valid: {valid})")
    return cls(cls.Options(**options))


def invalid_action(observation: str, action: str, actions: tuple[str, ...]) -> StepResult:
    """The step result of an action the game does not know: the episode ends, reward 0."""
    return StepResult(observation, 0.0, True, {"outcome": "invalid_action", "action": action,
                                               "valid": list(actions)})
