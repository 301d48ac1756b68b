"""`flash replay RUN_DIR`: re-train a finished (or stopped) run from its schedule record.

An asynchronous run's batches depend on timing -- which groups finished first, at which policy
versions, which responses a weight update interrupted -- so running the recipe again trains on
other batches. The run recorded what its schedule decided (``schedule.jsonl``, flash.app.schedule);
the replay starts the trainer (and the critic, for ``gae``) exactly as the run did -- the same
initial checkpoint, seed and torch threads -- and feeds it the recorded batches in order, through
the controller's own train step (flash.controllers.train_step). Training is deterministic given its
inputs, so every step's loss and gradient norm must come out bit for bit; the first step where one
does not is where the run's numbers stop being explained by its recorded data.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import ray

from flash import algos
from flash.controllers.prox_mode import PROX_SOURCES
from flash.controllers.train_step import StepPlan, StepRoles, train_batch, train_stream
from flash.app.config import FlashConfig, load_config
from flash.app.roles import start_critic_role, start_reference_role, start_trainer_role
from flash.app.schedule import CHECKED, count_steps, groups_from_line, schedule_lines
from flash.cluster import init_ray, pinned_threads, quiet, wait_ready
from flash.errors import FlashError
from flash.run_files import write_run_text
from flash.train.batch import collate, flatten


@dataclass
class StepCheck:
    step: int
    recorded: dict[str, float]
    replayed: dict[str, float]

    @property
    def identical(self) -> bool:
        return all(_same(self.recorded[k], self.replayed.get(k)) for k in self.recorded)

    def line(self) -> dict:
        return {
            "step": self.step,
            "identical": self.identical,
            **{f"{k}_recorded": v for k, v in self.recorded.items()},
            **{f"{k}_replayed": self.replayed.get(k) for k in self.recorded},
        }


def _same(a: float, b: float | None) -> bool:
    """Bitwise equality of two floats (NaN equals NaN: a skipped step replays as skipped)."""
    return b is not None and (a == b or (math.isnan(a) and math.isnan(b)))


def replay(run_dir: str | Path, steps: int | None = None, out: str | Path | None = None) -> dict:
    """Re-train ``run_dir``'s first ``steps`` recorded steps (all by default); returns the summary
    and writes one line per step to ``out`` when given."""
    run_dir = Path(run_dir)
    config = run_dir / "config.yaml"
    if not config.is_file():
        raise FlashError(f"{config} not found: `flash replay` takes the run dir of a `flash run`")
    cfg = load_config(config)
    if not count_steps(run_dir, steps):  # the whole record checked before a trainer starts
        raise FlashError(f"{run_dir}/schedule.jsonl records no step: the run stopped before its first")
    tally = Tally()
    with pinned_threads(cfg.resources.driver_threads):
        checks = _replay_lines(cfg, schedule_lines(run_dir, steps), tally)
    summary = _summary(run_dir, tally, checks)
    if out is not None:
        write_run_text(out, "".join(json.dumps(c.line()) + "\n" for c in checks))
    return summary


def _replay_lines(cfg: FlashConfig, lines: Iterator[dict], tally: Tally) -> list[StepCheck]:
    """Each recorded step trained and checked, one line of the record in memory at a time."""
    from transformers import AutoTokenizer

    from flash.app.runner import prepare_model
    from flash.app.settings import run_cores, trainer_settings
    from flash.app.data import build_task

    quiet()
    algos.load_plugins(list(cfg.plugins))
    first = next(lines)
    threads = _context(first)
    task = build_task(cfg)
    model_path = prepare_model(cfg, task)  # the cached warm start, or built again the same way
    pad_id = AutoTokenizer.from_pretrained(model_path).pad_token_id or 0
    init_ray(cfg.ray.address, run_cores(cfg))
    trainer = start_trainer_role(cfg, model_path, trainer_settings(cfg), threads)
    critic = start_critic_role(cfg, model_path, threads)
    reference = start_reference_role(cfg, model_path, threads)
    actors = [a for a in (trainer, critic, reference) if a is not None]
    try:
        wait_ready(*actors, timeout=cfg.resources.ready_timeout_s)
        checks = []
        for line in itertools.chain([first], lines):
            checks.append(_check(line, _train(line, cfg, (trainer, critic, reference), pad_id)))
            tally.add(line)  # after _train: its groups_from_line checked every field tally reads
        return checks
    finally:
        for actor in actors:
            ray.kill(actor)


def _context(line: dict) -> int:
    """The first line's trainer threads, checked (the numbers depend on them)."""
    threads = line.get("trainer_threads")
    if not isinstance(threads, int) or not 1 <= threads <= 4096:
        raise FlashError(f"schedule step {line['step']}: trainer_threads {threads!r} is not a thread count")
    return threads


def _train(line: dict, cfg: FlashConfig, actors: tuple, pad_id: int) -> dict[str, float]:
    """One recorded step through the trainer by the controller's own step (flash.controllers.train_step,
    with no timed phases); ``actors``: the trainer, the critic and the reference (the last two may
    be None). Returns the trainer's metrics, the critic's beside them."""
    roles = StepRoles(*actors)
    groups = groups_from_line(line)
    prox_mode, adv_cfg = line.get("prox"), dict(cfg.algo.advantage)
    if prox_mode not in PROX_SOURCES:
        raise FlashError(f"schedule step {line['step']}: prox {prox_mode!r} is not one of {', '.join(PROX_SOURCES)}")
    if line.get("stream"):  # each group backpropagated on its own, in the order they arrived
        return train_stream(roles, ([g] for g in groups), adv_cfg, pad_id)[1]
    batch = collate(flatten(groups), pad_id=pad_id)
    return train_batch(roles, batch, line["step"], StepPlan(prox_mode, adv_cfg)).train


def _check(line: dict, replayed: dict[str, float]) -> StepCheck:
    recorded = line.get("train")
    if not isinstance(recorded, dict) or not recorded:
        raise FlashError(f"schedule step {line['step']}: no recorded train metrics to compare with")
    bad = [k for k, v in recorded.items() if k not in CHECKED or not isinstance(v, (int, float))]
    if bad:
        raise FlashError(f"schedule step {line['step']}: train metric {bad[0]!r} is not one of {', '.join(CHECKED)}")
    return StepCheck(
        line["step"],
        {k: float(v) for k, v in recorded.items()},
        {k: float(replayed[k]) for k in recorded if k in replayed},
    )


@dataclass
class Tally:
    """What the schedule decided, counted line by line: the staleness of trained samples (steps
    behind the policy that trains them), and the responses a weight update interrupted."""

    stale: dict[int, int] = field(default_factory=dict)
    samples: int = 0
    interrupted: int = 0

    def add(self, line: dict) -> None:
        for group in line["groups"]:
            for s in group["samples"]:
                self.samples += 1
                self.interrupted += bool(s.get("interrupts"))
                age = line["step"] - min(s["versions"], default=s["admitted_version"])
                self.stale[age] = self.stale.get(age, 0) + 1


def _summary(run_dir: Path, tally: Tally, checks: list[StepCheck]) -> dict:
    """What the schedule decided and whether the replay found every step's numbers again."""
    mismatched = [c for c in checks if not c.identical]
    return {
        "run_dir": str(run_dir),
        "steps": len(checks),
        "identical": len(checks) - len(mismatched),
        "first_mismatch": mismatched[0].line() if mismatched else None,
        "samples": tally.samples,
        "interrupted_samples": tally.interrupted,
        "staleness": {str(k): tally.stale[k] for k in sorted(tally.stale)},
    }


def describe(summary: dict) -> str:
    """The replay's one-line verdict for the terminal."""
    head = (
        f"flash replay: {summary['steps']} steps of {summary['run_dir']} ({summary['samples']} samples, "
        f"{summary['interrupted_samples']} interrupted by a weight update, staleness {summary['staleness']})"
    )
    bad = summary["first_mismatch"]
    if bad is None:
        return f"{head}: every step's loss and gradient norm identical"
    detail = ", ".join(
        f"{k[:-9]} recorded {bad[k]!r} replayed {bad[k[:-9] + '_replayed']!r}" for k in bad if k.endswith("_recorded")
    )
    return f"{head}: step {bad['step']} differs first ({detail}); {summary['identical']} steps identical"
