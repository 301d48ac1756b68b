"""The candidate grid of ``flash plan`` (``flash.app.plan``): ``key=v1,v2`` items over the keys a
plan may vary (config keys, so a row can be pasted into ``flash run``), every combination as a
``plan_model.Setting`` with the run's values for the keys not given. Each value is checked; a tail
threshold ``pNN`` is that percentile of the run's response lengths, and the scheduler's defaults
fill the tail-batching knobs not given.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

from flash.app import plan_model as pm
from flash.controllers.tail_policy import SCHEDULERS
from flash.errors import ConfigError

# candidate key -> (Setting field, parser); config keys, so a row can be pasted into `flash run`
KEYS = {
    "async_ratio": ("async_ratio", float),
    "resources.engine_threads": ("engine_threads", int),
    "resources.trainer_threads": ("trainer_threads", int),
    "placement.roles.actor_infer.num_workers": ("replicas", int),
    "rollout.scheduler": ("tail", lambda v: {s: s == "tail_batching" for s in SCHEDULERS}[v]),
    "rollout.tail_batching.threshold": ("tail_threshold", float),
    "rollout.tail_batching.over_provision": ("tail_overprovision", float),
    "rollout.tail_batching.long_round_queue": ("tail_long_queue", int),
    "rollout.tail_batching.long_round_every": ("tail_long_every", int),
}
TAIL = "rollout.tail_batching."
TAIL_DEFAULTS = {"threshold": "p90", "over_provision": 1.25}  # controllers/tail_policy.TailConfig


def _parse_value(key: str, raw: str, lengths: list[int]):
    """One candidate value, checked; a tail threshold may be ``pNN`` (that percentile of the
    recorded response lengths)."""
    field_name, parse = KEYS[key]
    if key == TAIL + "threshold" and raw.lower() in ("inf", "infinity", "none"):
        return field_name, math.inf
    if key == TAIL + "threshold" and raw.startswith("p"):
        q = float(raw[1:])
        if not 0 < q <= 100:
            raise ConfigError(f"{key}={raw}: a percentile must be in (0, 100]")
        ranked = sorted(lengths)
        return field_name, float(ranked[min(len(ranked) - 1, math.ceil(q / 100 * len(ranked)) - 1)])
    try:
        value = parse(raw)
    except (ValueError, KeyError):
        from flash.app.keys import closest

        hint = closest(raw, list(SCHEDULERS)) if key == "rollout.scheduler" else ""
        raise ConfigError(f"invalid value '{raw}' for '{key}'{hint}") from None
    lows = {
        "async_ratio": 0,
        "resources.engine_threads": 0,
        "resources.trainer_threads": 0,
        "placement.roles.actor_infer.num_workers": 1,
        TAIL + "threshold": 1,
        TAIL + "over_provision": 1,
        TAIL + "long_round_queue": 0,
        TAIL + "long_round_every": 0,
    }
    if key in lows and not (value >= lows[key] and math.isfinite(value)):
        raise ConfigError(f"'{key}' must be a finite number >= {lows[key]}, got {raw}")
    return field_name, value


def parse_candidates(items: list[str], trace: pm.Trace) -> list[tuple[dict[str, str], pm.Setting]]:
    """``key=v1,v2`` items → every combination as (the values as written, its Setting); keys not
    given keep the run's values. Unknown keys name the closest valid one."""
    from flash.app.keys import closest
    from flash.app.sweep import parse_grid

    fixed, swept = parse_grid(items)
    grid = {k: [v] for k, v in (f.split("=", 1) for f in fixed)} | swept
    for key in grid:
        if key not in KEYS:
            raise ConfigError(f"unknown plan key '{key}'{closest(key, list(KEYS))}; valid: {', '.join(KEYS)}")
    tail_keys = [k for k in grid if k.startswith(TAIL)]
    if tail_keys and "tail_batching" not in grid.get("rollout.scheduler", []):
        raise ConfigError(
            f"{tail_keys[0]} is a tail-batching knob: add rollout.scheduler=tail_batching "
            f"(or rollout.scheduler=plain,tail_batching to compare)"
        )
    lengths = [x for g in trace.groups for x in g]
    out, seen = [], set()
    for combo in itertools.product(*grid.values()):
        written = dict(zip(grid, combo))
        if written.get("rollout.scheduler") == "plain":  # tail knobs mean nothing there: one row
            written = {k: ("-" if k.startswith(TAIL) else v) for k, v in written.items()}
        if tuple(written.items()) in seen:
            continue
        seen.add(tuple(written.items()))
        values = dict(_parse_value(k, v, lengths) for k, v in written.items() if v != "-")
        base = trace.setting
        if values.get("tail"):  # the scheduler's defaults for knobs not given
            for knob, default in TAIL_DEFAULTS.items():
                if TAIL + knob not in written:
                    values.update([_parse_value(TAIL + knob, default, lengths)])
        out.append((written, replace(base, **values)))
    return out
