"""How a recipe's layers merge (the defaults, its ``base:`` recipes, the recipe, the overrides), as
plain mappings, before OmegaConf builds the typed config from the result.

A later layer's keys override an earlier one's and its mappings merge into the earlier ones, with
two ways to remove: a mapping set to ``{}`` (or ``null`` where a mapping was) is emptied, and a
choice-keyed mapping (one with a ``name``: ``task``, ``reward.fn``, ``algo.loss``, ...) whose
``name`` changes starts from that choice's defaults: the earlier choice's keys are dropped (named
in a note), since they are knobs of a choice no longer made. Both are the same in a recipe and on
the command line (``task.name=reasoning_gym task.dataset=leg_counting`` over ``math``)."""

from __future__ import annotations

from typing import Any, NamedTuple


class Merged(NamedTuple):
    settings: dict  # the merged mapping
    whole: list[str]  # dotted keys set whole (emptied or a new choice): not merged into the schema's defaults
    notes: list[str]  # one line per choice that dropped the earlier choice's keys


def merge_layers(layers: list[dict]) -> Merged:
    """The layers merged in order (see the module docstring)."""
    out: dict = {}
    whole: list[str] = []
    notes: list[str] = []
    for layer in layers:
        out = _overlay(out, layer, "", whole, notes)
    return Merged(out, list(dict.fromkeys(whole)), notes)


def _overlay(base: dict, top: dict, prefix: str, whole: list[str], notes: list[str]) -> dict:
    out = dict(base)
    for k, v in top.items():
        key, old = f"{prefix}{k}", out.get(k)
        if (v is None and isinstance(old, dict)) or (isinstance(v, dict) and not v):
            out[k] = {}
            whole.append(key)
        elif isinstance(v, dict) and isinstance(old, dict) and _new_choice(old, v):
            dropped = [f"{key}.{x}" for x in old if x != "name" and x not in v]
            if dropped:
                notes.append(
                    f"{key}.name={v['name']} replaces {old['name']}: dropped {', '.join(dropped)} "
                    f"(its keys; {v['name']} starts from its own defaults)"
                )
            out[k] = v
            whole.append(key)
        elif isinstance(v, dict) and isinstance(old, dict):
            out[k] = _overlay(old, v, f"{key}.", whole, notes)
        else:
            out[k] = v
    return out


def _new_choice(old: dict, new: dict) -> bool:
    return "name" in old and "name" in new and new["name"] != old["name"]


def value_at(settings: dict, key: str) -> Any:
    """The value at a dotted key of a nested mapping."""
    for part in key.split("."):
        settings = settings[part]
    return settings
