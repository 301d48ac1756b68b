"""Strict keys: a user's mapping checked against a config dataclass, unknown keys refused with
the closest valid name. Generic over the schema so that both the schema (``flash.app.config``) and
the value checks (``flash.app.config_checks``) use it without importing each other.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any, Optional

from algos.registry import closest_names
from flash.errors import ConfigError


def closest(name: str, valid: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the nearest valid name, or '' when nothing is near."""
    match = closest_names(name, valid, n=1)
    return f" (did you mean '{match[0]}'?)" if match else ""


def check_keys(user: Any, schema: type, prefix: str = "") -> None:
    """Raise ConfigError for the first key in ``user`` that the dataclass ``schema`` lacks."""
    if not isinstance(user, dict):
        return
    by_name = {f.name: f for f in fields(schema)}
    for key, value in user.items():
        path = f"{prefix}{key}"
        if key not in by_name:
            valid = sorted(by_name)
            raise ConfigError(
                f"unknown config key '{path}'{closest(str(key), valid)}; "
                f"valid keys{' under ' + prefix.rstrip('.') if prefix else ''}: {', '.join(valid)}"
            )
        sub = _dataclass_type(by_name[key])
        if sub is not None:
            check_keys(value, sub, prefix=f"{path}.")


def _dataclass_type(f: Any) -> Optional[type]:
    default = f.default_factory() if callable(getattr(f, "default_factory", None)) else None
    return type(default) if default is not None and is_dataclass(default) else None
