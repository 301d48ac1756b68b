"""Strict keys: a user's mapping checked against a config dataclass, unknown keys refused with
the closest valid name, and a value outside a ``Literal[...]`` field's choices refused with the
closest valid value (docs/design.md invariant 6), before OmegaConf merges it. Generic over the schema
so that both the schema (``flash.app.config``) and the value checks (``flash.app.config_checks``)
use it without importing each other.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from functools import cache
from typing import Any, Literal, get_args, get_origin, get_type_hints

from flash.algos.registry import closest_names
from flash.errors import ConfigError


def closest(name: str, valid: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the nearest valid name, or '' when nothing is near."""
    match = closest_names(name, valid, n=1)
    return f" (did you mean '{match[0]}'?)" if match else ""


def choices(hint: Any) -> tuple | None:
    """The values a ``Literal[...]`` type hint allows (``Optional[Literal[...]]``: None too); None
    for any other hint."""
    if get_origin(hint) is Literal:
        return get_args(hint)
    args = get_args(hint)
    if len(args) == 2 and type(None) in args:  # Optional[...]
        inner = choices(next(a for a in args if a is not type(None)))
        return None if inner is None else (*inner, None)
    return None


@cache
def field_choices(schema: type) -> dict[str, tuple]:
    """``{field: allowed values}`` for the ``Literal``-typed fields of the dataclass ``schema``."""
    hints = get_type_hints(schema)
    return {f.name: c for f in fields(schema) if (c := choices(hints[f.name])) is not None}


def check_choice(key: str, value: Any, allowed: tuple) -> None:
    """ConfigError naming ``key``, its choices and the closest one when ``value`` is not one."""
    if value in allowed and type(value) in {type(a) for a in allowed}:
        return
    names = [str(a) for a in allowed if a is not None]
    raise ConfigError(f"{key} must be one of {', '.join(names)}, got '{value}'{closest(str(value), names)}")


def check_keys(user: Any, schema: type, prefix: str = "") -> None:
    """Raise ConfigError for the first key in ``user`` that the dataclass ``schema`` lacks, or
    whose value is not one of its ``Literal`` field's choices."""
    if not isinstance(user, dict):
        return
    by_name = {f.name: f for f in fields(schema)}
    allowed = field_choices(schema)
    for key, value in user.items():
        path = f"{prefix}{key}"
        if key not in by_name:
            valid = sorted(by_name)
            raise ConfigError(
                f"unknown config key '{path}'{closest(str(key), valid)}; "
                f"valid keys{' under ' + prefix.rstrip('.') if prefix else ''}: {', '.join(valid)}"
            )
        if key in allowed and not _interpolation(value):
            check_choice(path, value, allowed[key])
        sub = _dataclass_type(by_name[key])
        if sub is not None:
            check_keys(value, sub, prefix=f"{path}.")


def check_choices(cfg: Any, prefix: str = "") -> None:
    """The ``Literal`` check of ``check_keys`` over a built config object (every field, nested)."""
    allowed = field_choices(type(cfg))
    for f in fields(cfg):
        value, key = getattr(cfg, f.name), f"{prefix}{f.name}"
        if f.name in allowed:
            check_choice(key, value, allowed[f.name])
        elif is_dataclass(value):
            check_choices(value, f"{key}.")


def _interpolation(value: Any) -> bool:
    """An OmegaConf ``${...}`` reference: checked once resolved (``check_choices``)."""
    return isinstance(value, str) and "${" in value


def _dataclass_type(f: Any) -> type | None:
    default = f.default_factory() if callable(getattr(f, "default_factory", None)) else None
    return type(default) if default is not None and is_dataclass(default) else None
