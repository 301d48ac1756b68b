"""Reward functions by name: built-ins (``math``, ``code``) and user functions by import path.

A reward section of a recipe names one function and its knobs::

    reward: {name: code, all_or_nothing: true}
    reward: {name: "my_pkg.rewards:exact_match", case_sensitive: false}

A reward function is ``fn(item, response, **knobs) -> float | RewardResult``: ``item`` is the
task's ``TaskItem`` (its ``answer`` and ``meta`` carry the reference), ``response`` the decoded
text. A *builder* (``register_reward(..., builder=True)``) is instead called once per worker with
the knobs and returns the scorer ``(item, response) -> float``; built-ins that keep state (the
code reward's adaptive timeout) are builders. A scorer may have a ``metrics() -> dict`` method.

Everything is checked before anything runs (DESIGN.md invariant 6): an unknown name names the
closest registered one, a bad import path says what failed, an unknown knob names the valid ones.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flash.errors import ConfigError

Scorer = Callable[[Any, str], Any]


@dataclass(frozen=True)
class _Entry:
    fn: Callable
    builder: bool


_REGISTRY: dict[str, _Entry] = {}


def register_reward(name: str, builder: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: ``@register_reward("exact")`` makes ``fn`` available as ``reward.name: exact``."""

    def wrap(fn: Callable) -> Callable:
        if name in _REGISTRY and _REGISTRY[name].fn is not fn:
            raise ValueError(f"reward {name!r} is already registered by {_REGISTRY[name].fn!r}")
        _REGISTRY[name] = _Entry(fn, builder)
        return fn

    return wrap


def registered_rewards() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def _load_builtins() -> None:
    from flash.rewards import builtin  # noqa: F401  (registers math and code)
    from flash.rewards import judge  # noqa: F401  (registers judge)


def _lookup(name: str) -> _Entry:
    if ":" in name:
        return _Entry(_import_path(name), builder=False)
    _load_builtins()
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown reward {name!r}{hint} (registered: {registered_rewards()}; "
                         "or name your own function as 'package.module:function')")
    return _REGISTRY[name]


def _import_path(path: str) -> Callable:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward import path {path!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward {path!r}: cannot import module {module_name!r}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        close = difflib.get_close_matches(attr, public, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"reward {path!r}: module {module_name!r} has no function {attr!r}{hint}")
    return fn


def _knob_names(entry: _Entry) -> list[str]:
    params = list(inspect.signature(entry.fn).parameters.values())
    if not entry.builder:
        params = params[2:]  # (item, response, ...)
    return [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]


def validate_reward(section: dict) -> None:
    """Raise ValueError for an unknown reward or knob (names the valid ones)."""
    knobs = dict(section)
    name = knobs.pop("name", None)
    if not isinstance(name, str) or not name:
        raise ValueError("reward.name is required: one of "
                         f"{registered_rewards()} or 'package.module:function'")
    entry = _lookup(name)
    valid = _knob_names(entry)
    for key in knobs:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown knob {key!r} for reward {name!r}{hint} (valid: {valid})")


def build_reward(section: dict) -> Scorer:
    """The scorer ``(item, response) -> float | RewardResult`` for a reward section."""
    validate_reward(section)
    knobs = dict(section)
    entry = _lookup(knobs.pop("name"))
    if entry.builder:
        return entry.fn(**knobs)
    return functools.partial(entry.fn, **knobs) if knobs else entry.fn


def check_pool_args(section: dict, num_workers: int, concurrency: int, timeout_s: float,
                    plugins: tuple[str, ...] = ()) -> None:
    """ConfigError for anything that would make the pool fail later (checked in the driver)."""
    for module in plugins:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"cannot import plugin module {module!r}: {exc}") from None
    try:
        validate_reward(section)
    except ValueError as exc:
        raise ConfigError(f"reward.fn: {exc}") from None
    if num_workers < 1 or concurrency < 1:
        raise ConfigError(f"reward workers need num_workers >= 1 and concurrency >= 1, "
                          f"got {num_workers} and {concurrency}")
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ConfigError(f"reward timeout_s must be a finite number > 0, got {timeout_s}")
