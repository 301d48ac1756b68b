"""Reward functions by name: built-ins (``math``, ``code``) and user functions by import path.

A reward section of a recipe names one function and its knobs::

    reward: {name: code, all_or_nothing: true}
    reward: {name: "my_pkg.rewards:exact_match", case_sensitive: false}

A reward function is ``fn(item, response, **knobs) -> float | RewardResult``: ``item`` is the
task's ``TaskItem`` (its ``answer`` and ``meta`` carry the reference), ``response`` the decoded
text. A *builder* (``register_reward(..., builder=True)``) is instead called once per worker with
the knobs and returns the scorer ``(item, response) -> float``; built-ins that keep state (the
code reward's adaptive timeout) are builders. A scorer may have a ``metrics() -> dict`` method.

Everything is checked before anything runs (docs/design.md invariant 6): an unknown name names the
closest registered one, a bad import path says what failed, an unknown knob names the valid ones.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

from flash.algos.registry import Entry, Registry, closest_error, import_path, load_plugins
from flash.errors import ConfigError

Scorer = Callable[[Any, str], Any]

# The built-ins register on first lookup, imported by name: they import this module, not it them.
REWARDS = Registry("reward", builtins=("flash.rewards.builtin", "flash.rewards.judge"))
IMPORT_HINT = "or name your own function as 'package.module:function'"


def _knob_defaults(fn: Callable, builder: bool) -> dict[str, Any]:
    """A reward's knobs: its parameters after ``(item, response)`` -- all of them for a builder."""
    params = list(inspect.signature(fn).parameters.values())
    if not builder:
        params = params[2:]
    return {
        p.name: (None if p.default is p.empty else p.default)
        for p in params
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    }


def register_reward(name: str, builder: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: ``@register_reward("exact")`` makes ``fn`` available as ``reward.name: exact``."""

    def wrap(fn: Callable) -> Callable:
        return REWARDS.register(name, knobs=_knob_defaults(fn, builder), meta={"builder": builder})(fn)

    return wrap


def registered_rewards() -> list[str]:
    return REWARDS.names()


def _lookup(name: str) -> Entry:
    """The entry of a registered reward, or of a user's ``package.module:function``."""
    if ":" in name:
        fn = _import_path(name)
        return Entry(name, fn, "", _knob_defaults(fn, False), meta={"builder": False})
    try:
        return REWARDS.get(name)
    except ValueError as exc:  # the registry's closest-name error, plus the import-path way
        raise ValueError(f"{str(exc)[:-1]}; {IMPORT_HINT})") from None


def _import_path(path: str) -> Callable:
    return import_path(path, "reward")


def validate_reward(section: dict) -> None:
    """Raise ValueError for an unknown reward or knob (names the valid ones)."""
    knobs = dict(section)
    name = knobs.pop("name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"reward.name is required: one of {registered_rewards()} or 'package.module:function'")
    entry = _lookup(name)
    for key in knobs:
        if key not in entry.knobs:
            raise closest_error("knob", key, entry.knobs, where=f" for reward {name!r}")


def build_reward(section: dict) -> Scorer:
    """The scorer ``(item, response) -> float | RewardResult`` for a reward section."""
    validate_reward(section)
    knobs = dict(section)
    entry = _lookup(knobs.pop("name"))
    if entry.meta.get("builder"):
        return entry.fn(**knobs)
    return functools.partial(entry.fn, **knobs) if knobs else entry.fn


def check_pool_args(
    section: dict, num_workers: int, concurrency: int, timeout_s: float, plugins: tuple[str, ...] = ()
) -> None:
    """ConfigError for anything that would make the pool fail later (checked in the driver)."""
    try:
        load_plugins(list(plugins))
    except ImportError as exc:
        raise ConfigError(str(exc)) from None
    try:
        validate_reward(section)
    except ValueError as exc:
        raise ConfigError(f"reward.fn: {exc}") from None
    if num_workers < 1 or concurrency < 1:
        raise ConfigError(
            f"reward workers need num_workers >= 1 and concurrency >= 1, got {num_workers} and {concurrency}"
        )
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ConfigError(f"reward timeout_s must be a finite number > 0, got {timeout_s}")
