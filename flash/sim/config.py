"""The ``sim:`` section of a recipe (simulated GPU roles): its fields, checks and cost model."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields, replace
from typing import Dict

from flash.sim.cost import CostModel, Efficiency, preset
from flash.sim.workload import load_lengths


@dataclass
class SimConfig:
    # Used by rollout.engine: sim and train.backend: sim. Cost model preset (flash.sim.cost.PRESETS).
    model: str = "qwen2.5-7b-h100"
    time_scale: float = 0.01  # real seconds slept per simulated second
    rollout_gpus: int = 8  # simulated GPUs of all engine replicas together
    train_gpus: int = 8  # simulated GPUs of the trainer
    tp: int = 0  # GPUs per engine instance; 0: the preset's
    # simulated tokens per generated token id: long responses with short token lists (the cost
    # model sees the simulated count; the trainer gets the ids)
    token_scale: int = 1
    prompt_tokens: int = 0  # simulated prompt length; 0: each prompt's own token count × token_scale
    # response lengths (simulated tokens): lognormal(ln median, sigma) capped at
    # rollout.max_new_tokens × token_scale; median 0: a quarter of that cap
    length_median: float = 0.0
    length_sigma: float = 1.0
    # or lengths observed in a real run (replacing the lognormal): a run dir, its ledger.jsonl
    # (a prompt draws one step-and-prompt group, its samples lengths of it), or a file of integers
    # (flash.sim.workload.load_lengths); "": the lognormal
    lengths: str = ""
    # per-prompt spread on top (flash.sim.workload.prompt_factor): a prompt's samples share a
    # median × exp(prompt_sigma · z); 0: every sample independent
    prompt_sigma: float = 0.0
    max_tokens_per_step: int = 8  # token ids per engine step (one real sleep): how late an arrival joins
    # Efficiency fields (flash.sim.cost.Efficiency) replacing the preset's, e.g. costs fitted to this
    # machine from real runs (bench/sim_fit.py --runs prints them): sim.eff.step_overhead_s=0.03
    eff: Dict[str, float] = field(default_factory=dict)


def check_sim(sim: SimConfig) -> str | None:
    """Why ``sim`` cannot run (one line naming the key), or None."""
    try:
        cm = preset(sim.model)
    except ValueError as exc:
        return str(exc)
    tp = sim.tp or cm.tp
    problems = [
        (sim.time_scale > 0, f"sim.time_scale must be > 0, got {sim.time_scale}"),
        (
            sim.rollout_gpus >= 1 and sim.train_gpus >= 1,
            f"sim.rollout_gpus and sim.train_gpus must be >= 1, got {sim.rollout_gpus} and {sim.train_gpus}",
        ),
        (sim.tp >= 0, f"sim.tp must be >= 0, got {sim.tp}"),
        (sim.rollout_gpus % tp == 0, f"sim.rollout_gpus={sim.rollout_gpus} is not a multiple of tp={tp}"),
        (sim.token_scale >= 1, f"sim.token_scale must be >= 1, got {sim.token_scale}"),
        (sim.prompt_tokens >= 0, f"sim.prompt_tokens must be >= 0, got {sim.prompt_tokens}"),
        (
            sim.length_median >= 0 and sim.length_sigma >= 0,
            f"sim.length_median and sim.length_sigma must be >= 0, got {sim.length_median} and {sim.length_sigma}",
        ),
        (sim.prompt_sigma >= 0, f"sim.prompt_sigma must be >= 0, got {sim.prompt_sigma}"),
        (sim.max_tokens_per_step >= 1, f"sim.max_tokens_per_step must be >= 1, got {sim.max_tokens_per_step}"),
    ]
    return next((msg for ok, msg in problems if not ok), None) or check_eff(sim.eff) or check_lengths(sim.lengths)


def check_lengths(path: str) -> str | None:
    """Why ``sim.lengths`` cannot be read (one line), or None (also when it is unset)."""
    if not path:
        return None
    try:
        load_lengths(path)
    except ValueError as exc:
        return str(exc)
    return None


def check_eff(eff: dict) -> str | None:
    """Why an ``sim.eff`` override cannot apply (an unknown field, with the closest; a negative value)."""
    names = [f.name for f in fields(Efficiency)]
    for key, value in eff.items():
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            return f"unknown key sim.eff.{key}" + (f"; did you mean sim.eff.{close[0]}?" if close else "")
        if not float(value) >= 0:
            return f"sim.eff.{key} must be >= 0, got {value}"
    return None


def cost_model(sim: SimConfig) -> CostModel:
    cm = preset(sim.model)
    if sim.eff:
        cm = replace(cm, eff=replace(cm.eff, **{k: float(v) for k, v in sim.eff.items()}))
    return cm.with_tp(sim.tp) if sim.tp else cm


def instances(sim: SimConfig, replicas: int) -> int:
    """Engine instances (``tp`` GPUs each) one of ``replicas`` engine actors simulates (>= 1)."""
    return max(1, sim.rollout_gpus // cost_model(sim).tp // max(1, replicas))
