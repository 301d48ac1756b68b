"""A step's metrics, assembled once from named sources.

Each source is a small function (or, where it needs the previous step's reading, a small class)
that names its own keys; ``assemble`` merges them in order. The controller feeds the sources of the
step itself (``AsyncController._metrics``: trainer, phases, batch, rollout state, scheduler,
weight push, role usage); the runner (flash.app.runner) feeds the run's (evaluation, elapsed time,
simulated seconds, reward pool, buffer service, guards, checkpoints, engine faults) through
``logged_metrics``. A key is made in one source only, so no metric is computed or renamed twice.

Names: ``train/*`` the trainer (and the critic, ``train/critic/*``); ``time/*`` wall seconds of the
step's phases; ``reward/*``, ``staleness/*``, ``rollout/*`` the batch and the rollout; ``buffer/*``
the SampleBuffer (and its zmq service); ``sim/*`` simulated seconds (flash.sim.accounting); ``agent/*`` the agent workflow's counts and
the facts agents reported (``facts_metrics``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flash.buffers.facts import facts_means
from flash.train.batch import TrainBatch
from flash.usage import IdleMeter

Metrics = dict[str, float]


def assemble(*sources: Mapping[str, float]) -> Metrics:
    """One step's metrics from its sources, merged in the order given."""
    out: Metrics = {}
    for source in sources:
        out.update(source)
    return out


MISMATCH = ("mismatch_mean", "mismatch_max", "mismatch_kl")  # flash.algos.mismatch_metrics


def trainer_metrics(train: Mapping[str, Any]) -> Metrics:
    """The trainer's (and the critic's) step metrics under ``train/``; the train–inference mismatch
    it measured (fused proximal policy) under ``rollout/``, where the separate recompute's goes, so
    it has one name in every mode."""
    return {f"{'rollout' if k in MISMATCH else 'train'}/{k}": float(v) for k, v in train.items()}


def phase_metrics(times: Mapping[str, float], step_s: float) -> Metrics:
    """Wall seconds of each timed phase, and of the whole step."""
    return {**{f"time/{k}": v for k, v in times.items()}, "time/step": step_s}


def batch_metrics(t: int, samples: Sequence, batch: TrainBatch) -> Metrics:
    """Rewards, staleness (``t`` − a sample's version) and response lengths of step ``t``'s batch."""
    rewards = batch.rewards
    stale = [t - s.version for s in samples]
    lengths = [len(s.response_ids) for s in samples]
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "staleness/max": float(max(stale)),
        "staleness/mean": sum(stale) / len(stale),
        "rollout/response_len_mean": sum(lengths) / len(lengths),
        "rollout/response_len_max": float(max(lengths)),
        **{f"staleness/count_{k}": float(stale.count(k)) for k in range(max(stale) + 1)},
    }


def facts_metrics(samples: Sequence) -> Metrics:
    """Each fact an agent reported (``Sample.facts``, flash.buffers.facts), averaged over the step's
    trained samples that report it: ``agent/<name>``."""
    return facts_means(s.facts for s in samples)


def token_metrics(batch: TrainBatch, step_s: float) -> Metrics:
    """The batch's trained tokens and their rate over the step."""
    tokens = float(batch.mask.sum())
    return {"train/batch_tokens": tokens, "train/tokens_per_s": tokens / step_s if step_s > 0 else 0.0}


def rollout_state(buffer_depth: int, admitted: int) -> Metrics:
    """Groups waiting in the SampleBuffer, prompts admitted so far."""
    return {"buffer/depth": float(buffer_depth), "rollout/admitted": float(admitted)}


def update_metrics(update_bytes: float, pushed: Mapping[str, float]) -> Metrics:
    """The weight push: bytes sent, and the model-update group's own metrics (``model_update/*``)."""
    return {"rollout/update_bytes": update_bytes, **pushed}


def eval_metrics(evaluated: Mapping[str, float], seconds: float) -> Metrics:
    """A held-out evaluation's metrics (``eval/*``) and its wall seconds."""
    return {**evaluated, "time/eval": seconds}


def service_metrics(stats: Mapping[str, float]) -> Metrics:
    """The zmq buffer service's counters (puts, gets, bytes, rejected_<reason>, ...) under
    ``buffer/``; its depth is the buffer's own (``rollout_state``)."""
    return {f"buffer/{k}": v for k, v in stats.items() if k != "depth"}


class PerStep:
    """Counters read as totals since a start, reported per step: the difference from the previous
    read, never negative (a replaced or retired worker's count leaves the sum)."""

    def __init__(self, *keys: str):
        self.keys = keys
        self.prev = {k: 0.0 for k in keys}

    def __call__(self, totals: Mapping[str, float]) -> Metrics:
        out = dict(totals)
        for k in self.keys:
            if k in out:
                out[k], self.prev[k] = max(0.0, out[k] - self.prev[k]), out[k]
        return out


class RoleUsage:
    """Idle ratio per role (``1 − Δbusy/Δwall`` since the previous read, so time spent between
    steps -- evaluation, logging -- counts too), CPU seconds and busy seconds per step, and
    generated tokens/s, from the engine's and the trainer's ``stats()``."""

    def __init__(self, clock: Callable[[], float] = time.process_time):
        self.meters = {"rollout": IdleMeter(), "train": IdleMeter()}
        self.clock = clock  # the driver's CPU seconds
        self.engine: dict[str, float] = {}
        self.trainer_busy = 0.0
        self.cpu: dict[str, float] = {}

    @property
    def started(self) -> bool:
        return self.meters["train"].started

    def start(self, engine: Mapping[str, float], trainer: Mapping[str, float]) -> None:
        """Open the first window of each role (at the start of the first step)."""
        self.engine, self.trainer_busy = dict(engine), trainer.get("busy_s", 0.0)
        self.cpu = {"train": trainer.get("cpu_s", 0.0), "driver": self.clock()}
        self.meters["rollout"].start(engine.get("busy_s", 0.0))
        self.meters["train"].start(trainer.get("busy_s", 0.0))

    def read(self, engine: Mapping[str, float], trainer: Mapping[str, float], step_s: float) -> Metrics:
        prev, self.engine = self.engine, dict(engine)
        self.trainer_busy, trainer_prev = trainer.get("busy_s", 0.0), self.trainer_busy
        # a restarted engine counts from zero again: its tokens since the restart, not a negative delta
        tokens = engine.get("tokens_generated", 0.0) - prev.get("tokens_generated", 0.0)
        tokens = tokens if tokens >= 0 else engine.get("tokens_generated", 0.0)
        delta = {
            k: max(0.0, engine.get(k, 0.0) - prev.get(k, 0.0))
            for k in ("busy_s", "decode_steps", "cpu_s", "sim_late_s")
        }
        cpu = {"train": trainer.get("cpu_s", 0.0), "driver": self.clock()}
        cpu_prev, self.cpu = self.cpu, cpu
        return {
            # CPU seconds per step of each role's processes (engine: its tree, e.g. vLLM's core; the
            # driver: the controller's process alone): what bounds an overlapped step on shared cores
            "rollout/cpu_s": delta["cpu_s"],
            "train/cpu_s": max(0.0, cpu["train"] - cpu_prev["train"]),
            "driver/cpu_s": max(0.0, cpu["driver"] - cpu_prev["driver"]),
            # per-step deltas for `flash plan` (flash.app.plan): engine busy seconds, decode iterations,
            # trainer busy seconds
            "rollout/busy_s": delta["busy_s"],
            "rollout/decode_steps": delta["decode_steps"],
            "train/busy_s": max(0.0, trainer.get("busy_s", 0.0) - trainer_prev),
            "rollout/idle_ratio": self.meters["rollout"].read(engine.get("busy_s", 0.0)),
            "train/idle_ratio": self.meters["train"].read(trainer.get("busy_s", 0.0)),
            "rollout/tokens_generated": tokens,
            "rollout/tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
            # GPU memory: each role's peak since the previous step's read (colocated: its phase)
            **{
                f"memory/{role}_peak_gb": s["mem_peak_gb"]
                for role, s in (("rollout", engine), ("train", trainer))
                if "mem_peak_gb" in s
            },
            # a simulated engine: real seconds its bookkeeping ran past the scaled GPU time
            **({"rollout/sim_late_s": delta["sim_late_s"]} if "sim_late_s" in engine else {}),
        }


def logged_metrics(
    step: Mapping[str, float],
    evaluated: Mapping[str, float],
    elapsed_s: float,
    sim: Callable[[Metrics], Metrics] | None,
    sources: Sequence[Mapping[str, float]],
) -> Metrics:
    """What a run logs for a step: the controller's metrics (``step``), a periodic evaluation's
    (with its ``time/eval``; empty when none ran), ``time/elapsed`` since training began, the
    simulated seconds of every ``time/*`` so far (``sim``, a simulated run), then the run's
    ``sources`` in order."""
    logged = assemble(step, evaluated, {"time/elapsed": elapsed_s})
    if sim is not None:
        logged.update(sim(logged))
    return assemble(logged, *sources)
