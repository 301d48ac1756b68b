"""AsyncController: the training cycle, written once as named, timed phases.

    get_batch → recompute_prox → advantages → train → suspend → push_weights → resume

``get_batch`` waits on the SampleBuffer for a batch the staleness rule accepts
(``StalenessManager.select_batch``); ``recompute_prox`` takes the trainer's logprobs at the start of
the step (the proximal policy of decoupled PPO); ``advantages`` runs the configured estimator;
``train`` is one optimizer step; ``suspend`` pauses the engines under the ``rollout.interrupt``
mode; ``push_weights`` copies the new weights into every engine and advances the version; ``resume``
lets the engines go on and the scheduler admit the prompts the new version allows.

With ``async_ratio = 0`` the scheduler has admitted exactly the batch's prompts, so rollout and
training alternate: the synchronous on-policy loop. With ``r > 0`` rollout of later batches goes on
while ``train`` runs; only ``suspend → resume`` stops it, briefly.

The controller only wires components (engine and trainer handles, scheduler, buffer); none of them
imports it.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import ray

import algos
from buffers import Group, SampleBuffer
from controllers.rollout_scheduler import RolloutScheduler
from controllers.staleness import StalenessManager
from flash.batch import collate, flatten
from flash.usage import IdleMeter

PHASES = ("get_batch", "recompute_prox", "advantages", "train", "suspend", "push_weights", "resume")


@dataclass
class ControllerSettings:
    prompts_per_step: int
    interrupt: str
    advantage: dict[str, Any]
    prox: str  # "behav" (prox = behaviour), "fused" (in the train forward), "separate" (own phase)
    pad_id: int = 0


@dataclass
class StepRecord:
    step: int
    metrics: dict[str, float]
    groups: list[Group] = field(default_factory=list)
    # Wall-clock (time.time()) spans for the run's timeline: each phase, the engine's busy spans
    # since the previous step, and the trainer's busy phases (flash.usage, `flash plot`).
    timeline: dict[str, Any] = field(default_factory=dict)


class AsyncController:
    def __init__(self, engine, trainer, scheduler: RolloutScheduler, buffer: SampleBuffer,
                 staleness: StalenessManager, settings: ControllerSettings, ledger=None):
        self.engine, self.trainer = engine, trainer
        self.scheduler, self.buffer, self.staleness = scheduler, buffer, staleness
        self.s = settings
        self.ledger = ledger
        self.version = 0
        self._times: dict[str, float] = {}
        self._spans: dict[str, list[float]] = {}
        self._engine_prev: dict[str, float] = {}
        self._engine_spans: list[list[float]] = []
        self._meters = {"rollout": IdleMeter(), "train": IdleMeter()}
        self._update_bytes = 0.0
        # Hooks (flash.runner): ``supervisor`` routes engine calls through flash.faults (restart on
        # death/hang); ``on_update(version)`` runs after a weight push and before the new version
        # admits prompts -- the quiet point where a checkpoint is taken.
        self.supervisor = None
        self.on_update: Callable[[int], None] | None = None

    @contextmanager
    def phase(self, name: str):
        start, wall = time.monotonic(), time.time()
        try:
            yield
        finally:
            self._times[name] = self._times.get(name, 0.0) + time.monotonic() - start
            self._spans[name] = [wall, time.time()]

    def run(self, steps: int, on_step: Callable[[StepRecord], None] | None = None,
            start: int = 0) -> list[StepRecord]:
        """Steps ``start .. steps-1`` (``start > 0``: resumed from a checkpoint)."""
        records = []
        for t in range(start, steps):
            record = self.step(t, admit_more=t + 1 < steps)
            records.append(record)
            if on_step:
                on_step(record)
        return records

    def step(self, t: int, admit_more: bool = True) -> StepRecord:
        """One pass of the cycle for train step ``t`` (the policy is at version ``t``).

        ``admit_more=False`` on the last step: the new version admits no prompts nobody will train.
        """
        self._times, self._spans = {}, {}
        if not self._meters["train"].started:
            self._start_usage()
        start = time.monotonic()
        with self.phase("get_batch"):
            groups = self._get_batch(t)
        samples = flatten(groups)
        batch = collate(samples, pad_id=self.s.pad_id)
        with self.phase("recompute_prox"):
            prox = {"behav": batch.behav_logp, "fused": None}.get(self.s.prox)
            if self.s.prox == "separate":
                prox = ray.get(self.trainer.logprobs.remote(batch))
        with self.phase("advantages"):
            knobs = {k: v for k, v in self.s.advantage.items() if k != "name"}
            adv = algos.compute_advantages(self.s.advantage["name"], batch.rewards,
                                           batch.group_ids, batch.mask, **knobs)
        with self.phase("train"):
            train_metrics = ray.get(self.trainer.train_step.remote(batch, adv, prox))
        self._update_weights(t + 1)
        self._write_ledger(t, groups)
        if self.on_update is not None:
            self.on_update(t + 1)
        if admit_more:
            self.scheduler.set_version(t + 1)
        metrics = self._metrics(t, samples, batch, prox, train_metrics, time.monotonic() - start)
        return StepRecord(step=t, metrics=metrics, groups=groups, timeline=self._timeline())

    def _get_batch(self, t: int) -> list[Group]:
        def select(groups: list[Group]):
            self.scheduler.check()
            versions = [g.version for g in groups]
            return self.staleness.select_batch(t, versions, self.scheduler.pending_versions())

        while True:
            try:
                return self.buffer.get_batch(self.s.prompts_per_step, select=select, timeout=1.0)
            except TimeoutError:
                self.scheduler.check()

    def _update_weights(self, new_version: int) -> None:
        weights = self.trainer.get_weights.remote()

        def cycle():
            with self.phase("suspend"):
                ray.get(self.engine.pause.remote(self.s.interrupt))
            with self.phase("push_weights"):
                self._update_bytes = float(ray.get(self.engine.update_weights.remote(weights, new_version)) or 0.0)
            with self.phase("resume"):
                ray.get(self.engine.resume.remote())

        if self.supervisor is None:
            cycle()
        else:  # an engine fault anywhere in the cycle: restart it, then the whole cycle again
            self.supervisor.run(cycle)
            self.supervisor.pushed(weights, new_version)
        self.version = new_version

    def _engine_get(self, name: str, *args):
        if self.supervisor is None:
            return ray.get(getattr(self.engine, name).remote(*args))
        return self.supervisor.call(name, *args)

    def _write_ledger(self, t: int, groups: list[Group]) -> None:
        if self.ledger is None:
            return
        for g in sorted(groups, key=lambda g: g.prompt_id):
            for s in g.samples:
                self.ledger.write(json.dumps({
                    "prompt_id": g.prompt_id, "data_index": g.data_index, "sample": s.sample_index,
                    "outcome": "trained", "step": t, "version": s.version, "reward": s.reward,
                }) + "\n")
        self.ledger.flush()

    def _metrics(self, t, samples, batch, prox, train_metrics, step_s) -> dict[str, float]:
        rewards = batch.rewards
        stale = [t - s.version for s in samples]
        lengths = [len(s.response_ids) for s in samples]
        m = {f"train/{k}": float(v) for k, v in train_metrics.items()}
        m.update({f"time/{k}": v for k, v in self._times.items()})
        m.update({
            "time/step": step_s,
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "staleness/max": float(max(stale)),
            "staleness/mean": sum(stale) / len(stale),
            "rollout/response_len_mean": sum(lengths) / len(lengths),
            "rollout/response_len_max": float(max(lengths)),
            "buffer/depth": float(len(self.buffer)),
            "rollout/admitted": float(self.scheduler.admitted),
        })
        m.update({f"staleness/count_{k}": float(stale.count(k)) for k in range(max(stale) + 1)})
        tokens = float(batch.mask.sum())
        m.update({"train/batch_tokens": tokens, "train/tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
                  "rollout/update_bytes": self._update_bytes})
        m.update(self._mismatch(batch, prox))
        m.update(self._role_metrics(step_s))
        return m

    def _mismatch(self, batch, prox) -> dict[str, float]:
        """Train–inference mismatch |behav − prox| on tokens generated by the current weights.

        (With the fused proximal policy the trainer measures it and it arrives as train/mismatch_*.)
        """
        if self.s.prox != "separate":
            return {}
        fresh = batch.mask * (batch.versions == self.version - 1).float()
        if float(fresh.sum()) == 0:
            return {}
        diff = (batch.behav_logp - prox).abs() * fresh
        return {"rollout/mismatch_mean": float(diff.sum() / fresh.sum()),
                "rollout/mismatch_max": float(diff.max())}

    def _start_usage(self) -> None:
        """Open the first idle-ratio window of each role at the start of the first step."""
        engine, trainer = self._engine_get("stats"), ray.get(self.trainer.stats.remote())
        self._engine_prev = engine
        self._meters["rollout"].start(engine.get("busy_s", 0.0))
        self._meters["train"].start(trainer.get("busy_s", 0.0))

    def _role_metrics(self, step_s: float) -> dict[str, float]:
        """Idle ratio per role (``1 − Δbusy/Δwall`` since the previous step's read, so time spent
        between steps -- evaluation, logging -- counts too) and generated tokens/s."""
        engine, self._engine_spans = self._engine_get("stats"), self._engine_get("busy_spans")
        trainer = ray.get(self.trainer.stats.remote())
        prev, self._engine_prev = self._engine_prev, engine
        # a restarted engine counts from zero again: its tokens since the restart, not a negative delta
        tokens = engine.get("tokens_generated", 0.0) - prev.get("tokens_generated", 0.0)
        tokens = tokens if tokens >= 0 else engine.get("tokens_generated", 0.0)
        return {
            "rollout/idle_ratio": self._meters["rollout"].read(engine.get("busy_s", 0.0)),
            "train/idle_ratio": self._meters["train"].read(trainer.get("busy_s", 0.0)),
            "rollout/tokens_generated": tokens,
            "rollout/tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
        }

    def _timeline(self) -> dict[str, Any]:
        """This step's spans; the trainer is busy in ``recompute_prox`` (when it runs) and ``train``."""
        busy = ["recompute_prox", "train"] if self.s.prox == "separate" else ["train"]
        return {"phases": dict(self._spans), "engine_busy": self._engine_spans,
                "trainer_busy": [self._spans[p] for p in busy if p in self._spans]}

    def shutdown_rollout(self) -> dict[str, list[int]]:
        """Stop admitting, abort training requests in flight; return what was left unfinished."""
        self.scheduler.stop_admission()
        for name, args in (("pause", ("continue",)), ("abort", (None,)), ("resume", ())):
            self._engine_get(name, *args)
        self.scheduler.quiesce()
        pending = self.scheduler.pending_ids()
        buffered = sorted(g.prompt_id for g in self.buffer.drain())
        if self.ledger is not None:
            for pid in pending:
                self.ledger.write(json.dumps({"prompt_id": pid, "outcome": "in_flight"}) + "\n")
            for pid in buffered:
                self.ledger.write(json.dumps({"prompt_id": pid, "outcome": "buffered"}) + "\n")
            self.ledger.flush()
        return {"in_flight": pending, "buffered": buffered}


def prox_mode(mode: str, async_ratio: float) -> str:
    """Where the proximal logprobs come from, for the config's ``algo.recompute_prox``.

    ``auto``: at r = 0 every sample is on-policy and prox equals behav (up to the train–inference
    mismatch), so behav is used, exactly as a plain synchronous loop does; at r > 0 the recompute
    is fused into the train forward (exact with one optimizer step per batch, one forward saved).
    ``always``: a separate forward before the step (its own timed phase). ``never``: behav.
    """
    if mode == "auto":
        return "fused" if async_ratio > 0 else "behav"
    return "separate" if mode == "always" else "behav"

