"""`flash plan` on a simulated run: seconds per step at other scales, in simulated seconds.

A run with simulated GPU roles (``rollout.engine: sim``, ``train.backend: sim``) sleeps each
simulated second for ``sim.time_scale`` real ones, so its wall times say nothing of a cluster.
This reads its times back in simulated seconds (``flash.sim.accounting``: GPU spans divided by
the time scale, the driver's time unscaled): engine busy and the train and push phases over
``sim.time_scale``, and ``sim/driver_s`` as it is. The model (``flash.app.plan_sim_model``) takes
its shape from the run's own cost model (``sim.model``, ``sim.eff``, ``sim.tp``) and fits on the
trace how far the run departs from it (``fit_sim``); candidates are scales: ``sim.rollout_gpus``,
``sim.train_gpus``, ``train.prompts_per_step`` and ``async_ratio``. The thread, replica and
tail-batching keys of a real run's plan do not apply: a simulated GPU's time does not run on
this machine's cores.

The costs are fitted on the steps after the first ``1 + ceil(r)`` (``sim_skip``: the first step
holds the start-up, and at ratio ``r`` the next ``ceil(r)`` take batches admitted before the cycle
settled, as ``bench/sim.py`` skips them). A prediction is the mean over the same window of a run
of ``steps`` steps, over ``SEEDS`` draws of the trace's groups.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
from dataclasses import dataclass, fields, replace
from pathlib import Path

from flash.app import plan_sim_model as sm
from flash.app.plan import _jsonl, _read_run
from flash.errors import ConfigError
from flash.sim.config import SimConfig, cost_model

# candidate key -> (Scale field, lowest value); config keys, so a row can be pasted into `flash run`
KEYS = {
    "sim.rollout_gpus": ("rollout_gpus", 1),
    "sim.train_gpus": ("train_gpus", 1),
    "train.prompts_per_step": ("prompts", 1),
    "async_ratio": ("async_ratio", 0),
}
SEEDS = 8  # draws of the trace's groups per prediction


@dataclass
class SimTrace:
    """What a simulated run dir says, in simulated seconds, reduced to what the model needs."""

    shape: sm.Shape
    costs: sm.SimCosts
    scale: sm.Scale  # the scale the run had
    groups: list[list[int]]  # every trained group's n response lengths (ids), steady steps in order
    steps: int  # the run's train.steps
    measured_step_s: float  # mean simulated seconds per steady step (sim/step_s)


def is_sim_run(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` ran simulated GPU roles (its config's ``train.backend`` is ``sim``)."""
    from omegaconf import OmegaConf

    from flash.app.config import read_recipe

    path = Path(run_dir) / "config.yaml"
    return path.is_file() and OmegaConf.select(read_recipe(path), "train.backend", default="") == "sim"


def sim_skip(async_ratio: float) -> int:
    """Warm-up steps of a simulated run: ``1 + ceil(r)`` (module docstring)."""
    return 1 + math.ceil(async_ratio)


def _sim_config(cfg) -> SimConfig:
    from omegaconf import OmegaConf

    section = OmegaConf.to_container(cfg.sim) if "sim" in cfg else {}
    return SimConfig(**{f.name: section[f.name] for f in fields(SimConfig) if f.name in section})


def measured_sim_step_s(run_dir: str | Path, skip: int | None = None) -> float:
    """A simulated run's mean ``sim/step_s`` over its steady steps (after ``sim_skip`` by default)."""
    from omegaconf import OmegaConf

    d = Path(run_dir)
    skip = sim_skip(float(OmegaConf.load(d / "config.yaml").async_ratio)) if skip is None else skip
    rows = [r for r in _jsonl(d / "metrics.jsonl") if "sim/step_s" in r and r["step"] > skip]
    if not rows:
        raise ConfigError(f"{d}: no sim/step_s after the first {skip} steps in metrics.jsonl (not a simulated run?)")
    return statistics.fmean(r["sim/step_s"] for r in rows)


def fit_sim(
    rows: list[dict], steps: list[list[list[int]]], shape: sm.Shape, scale: sm.Scale, time_scale: float
) -> sm.SimCosts:
    """The departures from the cost model on the steady ``rows`` and their steps' groups:

    ``k_e = Σ busy / Σ replayed engine seconds`` (the steps' own groups, in order, through
    ``simulate`` at the run's scale with ``k_e = 1``; an async replay admits ahead, so it cycles
    through them and skips its own warm-up), ``k_t = Σ (train + recompute_prox) / Σ train_step(tokens)``,
    ``W = mean push_weights`` (the first three over ``time_scale``), ``d = Σ sim/driver_s / Σ rows``."""

    def sim_s(key: str) -> float:
        return sum(float(r.get(key, 0.0)) for r in rows) / time_scale

    train_model = sum(
        sm.train_s(shape, sum(sm.group_tokens(shape, g) for g in st), scale.train_gpus, sm.SimCosts()) for st in steps
    )
    flat = [g for st in steps for g in st]
    warm = sim_skip(scale.async_ratio) if scale.async_ratio > 0 else 0  # a synchronous replay is exact
    replay = sm.simulate(itertools.cycle(flat), shape, scale, sm.SimCosts(), warm + len(steps))
    return sm.SimCosts(
        engine_factor=sim_s("rollout/busy_s") / max(sum(replay.engine_s[warm:]), 1e-9),
        train_factor=(sim_s("time/train") + sim_s("time/recompute_prox")) / max(train_model, 1e-9),
        push_s=sim_s("time/push_weights") / len(rows),
        driver_per_row_s=sum(float(r.get("sim/driver_s", 0.0)) for r in rows) / max(sum(len(g) for g in flat), 1),
    )


def load_sim_trace(run_dir: str | Path) -> SimTrace:
    """Read and fit one finished simulated run dir (its steps after ``sim_skip``)."""
    from omegaconf import OmegaConf

    d = Path(run_dir)
    r = float(OmegaConf.load(d / "config.yaml").async_ratio)
    cfg, _, rows, steps, plens = _read_run(d, sim_skip(r))
    sim = _sim_config(cfg)
    cm = cost_model(sim)
    prompt = sim.prompt_tokens or (statistics.fmean(plens) if plens else 0.0) * sim.token_scale
    shape = sm.Shape(cm, int(cfg.rollout.n), sim.token_scale, float(prompt), int(cfg.rollout.max_num_seqs))
    scale = sm.Scale(sim.rollout_gpus, sim.train_gpus, int(cfg.train.prompts_per_step), r)
    if any("sim/step_s" not in row for row in rows):
        raise ConfigError(f"{d}: metrics.jsonl has no sim/step_s (a run before simulated accounting); record a new run")
    if any("rollout/episodes/turns" in row for row in rows):  # the model's rounds are single responses
        raise ConfigError(
            f"{d}: a multi-turn episode run; flash plan models single-turn rollouts (turns and "
            f"environment latency are not in its model)"
        )
    return SimTrace(
        shape=shape,
        costs=fit_sim(rows, steps, shape, scale, sim.time_scale),
        scale=scale,
        groups=[g for st in steps for g in st],
        steps=int(cfg.train.steps),
        measured_step_s=statistics.fmean(row["sim/step_s"] for row in rows),
    )


def predict_sim(trace: SimTrace, scale: sm.Scale, steps: int | None = None, seeds: int = SEEDS) -> dict[str, float]:
    """Mean simulated seconds per step at ``scale`` over the steps after ``sim_skip`` of a run of
    ``steps`` steps (default: the trace's), and its engine and train parts; groups drawn with
    replacement from the trace's, ``seeds`` times."""
    steps = steps or trace.steps
    skip = min(sim_skip(scale.async_ratio), steps - 1)
    parts = {"step_s": [], "engine_s": [], "train_s": []}
    for seed in range(seeds):
        rng = random.Random(seed)
        out = sm.simulate(iter(lambda r=rng: r.choice(trace.groups), None), trace.shape, scale, trace.costs, steps)
        for name in parts:
            parts[name] += getattr(out, name)[skip:]
    return {name: statistics.fmean(v) for name, v in parts.items()}


def parse_scales(items: list[str], trace: SimTrace) -> list[tuple[dict[str, str], sm.Scale]]:
    """``key=v1,v2`` items → every combination as (the values as written, its Scale); keys not given
    keep the run's values. A key that is not a scale, or a bad value, is a one-line ConfigError."""
    from flash.app.keys import closest
    from flash.app.sweep import parse_grid

    fixed, swept = parse_grid(items)
    grid = {k: [v] for k, v in (f.split("=", 1) for f in fixed)} | swept
    for key in grid:
        if key not in KEYS:
            raise ConfigError(
                f"unknown plan key '{key}' for a simulated run{closest(key, list(KEYS))}; "
                f"valid: {', '.join(KEYS)} (threads and tail batching apply to real runs)"
            )
    out = []
    for combo in itertools.product(*grid.values()):
        written = dict(zip(grid, combo))
        values = {}
        for key, raw in written.items():
            name, low = KEYS[key]
            try:
                value = float(raw) if key == "async_ratio" else int(raw)
            except ValueError:
                raise ConfigError(f"invalid value '{raw}' for '{key}'") from None
            if not (value >= low and math.isfinite(value)):
                raise ConfigError(f"'{key}' must be a finite number >= {low}, got {raw}")
            values[name] = value
        scale = replace(trace.scale, **values)
        if scale.rollout_gpus % trace.shape.cm.tp:
            raise ConfigError(f"sim.rollout_gpus={scale.rollout_gpus} is not a multiple of tp={trace.shape.cm.tp}")
        out.append((written, scale))
    return out


def plan_sim(run_dir: str | Path, items: list[str], out=print, steps: int | None = None) -> list[dict]:
    """Predict every candidate scale of a simulated run, print the ranked table (fastest first) and a
    final JSON line; returns the rows. Times are simulated seconds."""
    trace = load_sim_trace(run_dir)
    own = predict_sim(trace, trace.scale, steps)
    rows = []
    for written, scale in parse_scales(items, trace):
        pred = predict_sim(trace, scale, steps)
        rows.append(
            {
                "settings": written,
                "predicted_sim_s_per_step": round(pred["step_s"], 3),
                "engine_s": round(pred["engine_s"], 3),
                "train_s": round(pred["train_s"], 3),
            }
        )
    rows.sort(key=lambda r: r["predicted_sim_s_per_step"])
    k, s = trace.costs, trace.scale
    out(
        f"flash plan: {run_dir}: simulated run ({s.rollout_gpus}+{s.train_gpus} GPUs, {s.prompts} prompts, "
        f"r={s.async_ratio:g}); times in SIMULATED seconds (sim.time_scale scaled back); "
        f"measured {trace.measured_step_s:.2f} s/step "
        f"(the model reproduces {own['step_s']:.2f}); fit: engine x{k.engine_factor:.3f} and trainer "
        f"x{k.train_factor:.3f} of the cost model {trace.shape.cm.model.name}, push {k.push_s:.2f} s, driver "
        f"{k.driver_per_row_s * 1e3:.3f} ms/row; no thread terms (simulated GPUs)"
    )
    keys = list(rows[0]["settings"]) if rows else []
    header = ["#", *keys, "sim s/step", "vs run", "engine s", "train s"]
    table = [
        [
            str(i + 1),
            *(r["settings"][key] for key in keys),
            f"{r['predicted_sim_s_per_step']:.2f}",
            f"{trace.measured_step_s / r['predicted_sim_s_per_step']:.2f}x",
            f"{r['engine_s']:.2f}",
            f"{r['train_s']:.2f}",
        ]
        for i, r in enumerate(rows)
    ]
    widths = [max(len(h), *(len(row[j]) for row in table)) if table else len(h) for j, h in enumerate(header)]
    for line in [header, *table]:
        out("  ".join(cell.ljust(w) for cell, w in zip(line, widths)))
    out(
        json.dumps(
            {
                "run_dir": str(run_dir),
                "units": "simulated seconds",
                "measured_s_per_step": round(trace.measured_step_s, 3),
                "model_s_per_step": round(own["step_s"], 3),
                "fit": {f.name: round(getattr(k, f.name), 6) for f in fields(k)},
                "candidates": rows,
            }
        )
    )
    return rows
