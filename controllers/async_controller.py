"""AsyncController: the training cycle, written once as named, timed phases.

    get_batch → recompute_prox → advantages → train → suspend → push_weights → resume

``get_batch`` waits on the SampleBuffer for a batch the staleness rule accepts
(``StalenessManager.select_batch``); ``recompute_prox`` takes the trainer's logprobs at the start of
the step (the proximal policy of decoupled PPO); ``advantages`` runs the configured estimator;
``train`` is one optimizer step; ``suspend`` pauses the engines under the ``rollout.interrupt``
mode; ``push_weights`` copies the new weights into every engine (the model-update group,
``flash.weights.group``) and advances the version once every replica has them; ``resume``
lets the engines go on and the scheduler admit the prompts the new version allows.

With ``async_ratio = 0`` the scheduler has admitted exactly the batch's prompts, so rollout and
training alternate: the synchronous on-policy loop. With ``r > 0`` rollout of later batches goes on
while ``train`` runs; only ``suspend → resume`` stops it, briefly.

The train step itself (reference call, proximal policy, advantages, train; plain or stream) is
``flash.controllers.train_step``, shared with `flash replay`; a step's metrics are assembled from the
named sources of ``flash.controllers.step_metrics``.

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

from flash import algos

from flash.buffers import Group, SampleBuffer
from . import step_metrics as sm
from .prox_mode import prox_mode  # noqa: F401 -- the controller's reading of algo.recompute_prox
from .scheduler import RolloutCore
from .staleness import StalenessManager
from .train_step import StepOut, StepPlan, StepRoles, train_batch, train_stream
from .workflows.base import SteppedEnvs
from flash.engine.client import EngineClient, EngineFault
from flash.train.batch import TrainBatch, collate, flatten

# sample meta copied into a trained sample's ledger line when present (tail batching's rounds)
LEDGER_META = ("round", "cut_from")
PHASES = ("get_batch", "recompute_prox", "advantages", "train", "suspend", "push_weights", "resume")


@dataclass
class ControllerSettings:
    prompts_per_step: int
    interrupt: str
    advantage: dict[str, Any]
    # "behav" (prox = behaviour), "fused" (in the train forward), "separate" (own phase),
    # "approx" (interpolated in the train forward, flash.algos.proximal)
    prox: str
    pad_id: int = 0
    stream: bool = False  # stream trainer: backward each group on arrival (async_ratio 0 only)
    # The engines share the trainer's devices (flash.placement): they are paused and put to sleep
    # (memory released) before the trainer runs, and woken before the weight push.
    colocated: bool = False
    # with prox "approx": run the real recompute too and report rollout/prox_approx_error
    measure_prox_error: bool = False


COLOCATED_SLEEP_LEVEL = 2


@dataclass
class StepRecord:
    step: int
    metrics: dict[str, float]
    groups: list[Group] = field(default_factory=list)
    # Wall-clock (time.time()) spans for the run's timeline: each phase, the engine's busy spans
    # since the previous step, and the trainer's busy phases (flash.usage, `flash plot`).
    timeline: dict[str, Any] = field(default_factory=dict)


class AsyncController:
    def __init__(
        self,
        engine,
        trainer,
        scheduler: RolloutCore,
        buffer: SampleBuffer,
        staleness: StalenessManager,
        settings: ControllerSettings,
        ledger=None,
        critic=None,
        model_update=None,
        supervisor: EngineClient | None = None,
        reference=None,
    ):
        self.engine, self.trainer, self.critic = engine, trainer, critic
        # the placed reference role (flash.train.reference) for a KL penalty; None: the trainer's copy
        self.reference = reference
        self.scheduler, self.buffer, self.staleness = scheduler, buffer, staleness
        self.s = settings
        self.ledger = ledger
        self.version = 0
        self._times: dict[str, float] = {}
        self._spans: dict[str, list[float]] = {}
        self._engine_spans: list[list[float]] = []
        self._env_spans: list[list[float]] = []  # environment steps in flight (episode workflows)
        self._usage = sm.RoleUsage()
        self._update_bytes = 0.0
        # flash.weights.group.ModelUpdateGroup (set up); None: the state dict through Ray's object store
        self.model_update = model_update
        self._update_metrics: dict[str, float] = {}
        # Every engine call goes through the EngineClient (flash.engine.client): the runner's restarts
        # a dead or hung engine; without one, a pass-through (a fault raises at once).
        self.supervisor = supervisor if supervisor is not None else EngineClient.passthrough(engine)
        # Hook (flash.app.runner): ``on_update(version)`` runs after a weight push and before the new
        # version admits prompts -- the quiet point where a checkpoint is taken.
        self.on_update: Callable[[int], None] | None = None
        self._mu_epoch = 0  # supervisor epoch the model-update group was formed at

    @contextmanager
    def phase(self, name: str):
        start, wall = time.monotonic(), time.time()
        try:
            yield
        finally:
            self._times[name] = self._times.get(name, 0.0) + time.monotonic() - start
            self._spans[name] = [wall, time.time()]

    def run(self, steps: int, on_step: Callable[[StepRecord], None] | None = None, start: int = 0) -> list[StepRecord]:
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
        if not self._usage.started:
            self._start_usage()
        start = time.monotonic()
        groups, batch, out = self._train_stream() if self.s.stream else self._train_batch(t)
        self._after_train(t, groups, admit_more)
        metrics = self._metrics(t, flatten(groups), batch, out.prox, out.train, time.monotonic() - start)
        metrics.update(out.rollout)
        return StepRecord(step=t, metrics=metrics, groups=groups, timeline=self._timeline())

    def _train_batch(self, t: int) -> tuple[list[Group], TrainBatch, StepOut]:
        """get_batch, then the step on the whole batch (``train_step.train_batch``, its parts timed)."""
        with self.phase("get_batch"):
            groups = self._get_batch(t)
        batch = collate(flatten(groups), pad_id=self.s.pad_id)
        plan = StepPlan(self.s.prox, self.s.advantage, self.s.measure_prox_error)
        out = train_batch(self._roles(), batch, t, plan, self.phase, self._free_devices if self.s.colocated else None)
        if self.s.colocated:  # still paused: the weight push below finds the weights on the device
            with self.phase("wake_up"):
                self._engine_get("wake_up")
        return groups, batch, out

    def _train_stream(self) -> tuple[list[Group], TrainBatch, StepOut]:
        """The stream trainer (``train_step.train_stream``): each group backpropagated as soon as it
        is in the buffer, while the rest of the batch still decodes; prox = behaviour."""
        groups, train = train_stream(self._roles(), self._stream_groups(), self.s.advantage, self.s.pad_id, self.phase)
        batch = collate(flatten(groups), pad_id=self.s.pad_id)
        return groups, batch, StepOut(train, batch.behav_logp)

    def _roles(self) -> StepRoles:
        return StepRoles(self.trainer, self.critic, self.reference)

    def _free_devices(self) -> None:
        """Colocated engines: paused and put to sleep before the trainer runs, at level 2 (weights
        discarded, not copied to the host: the push after the step overwrites every one of them)."""
        with self.phase("sleep"):
            self._engine_get("pause", self.s.interrupt)
            self._engine_get("sleep", COLOCATED_SLEEP_LEVEL)

    def _stream_groups(self):
        """The step's groups one by one as they finish (at async_ratio 0 every buffered group is of
        this step): the stream trainer's parts."""
        count = 0
        while count < self.s.prompts_per_step:
            group = self._next_group()
            count += len(group)
            yield group

    def _after_train(self, t: int, groups: list[Group], admit_more: bool) -> None:
        """Push the new weights, settle the batch (lifecycle, ledger), then the ``on_update`` hook
        (a checkpoint's quiet point: nothing admitted under the new version yet), then admission."""
        self._update_weights(t + 1)
        self.scheduler.mark_trained(groups)
        self._write_ledger(t, groups)
        if self.on_update is not None:
            self.on_update(t + 1)
        if admit_more:
            self.scheduler.set_version(t + 1)

    def _next_group(self) -> list[Group]:
        """Any one finished group."""
        while True:
            try:
                return self.buffer.get_batch(1, timeout=1.0)
            except TimeoutError:
                self.scheduler.check()

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
        """suspend → push_weights → resume, through the EngineClient (flash.engine.client): an engine
        fault anywhere in it restarts the engine (when restarts are allowed) and runs the whole cycle
        again; a restarted engine is given the weights last pushed (``EngineClient.pushed``)."""
        weights = None

        def cycle():
            nonlocal weights
            with self.phase("suspend"):
                self._engine_get_once("pause", self.s.interrupt)
                self.scheduler.check()
            with self.phase("push_weights"):
                if self.model_update is not None:  # returns after every replica acknowledged
                    self._push_group(new_version)
                else:
                    weights = self.trainer.get_weights.remote()
                    self._update_bytes = float(self._engine_get_once("update_weights", weights, new_version) or 0.0)
            with self.phase("resume"):
                self._engine_get_once("resume")

        def cycle_and_record():
            cycle()
            # with the model-update group nothing sits in the object store: a restarted engine
            # fetches the trainer's weights then (flash.engine.client.EngineClient.pushed)
            self.supervisor.pushed(weights if weights is not None else self.trainer.get_weights.remote, new_version)

        # exclusive: no replica recovery loads older weights in the middle of this push
        # (behind a router the update goes on with the replicas in service meanwhile)
        self.supervisor.run(cycle_and_record, exclusive=True)
        self.version = new_version

    def _push_group(self, version: int) -> None:
        """``model_update.push``; after an engine restart the group is formed again first (the new
        engine process is in no group), and a push that fails on the engine side is an engine fault."""
        try:
            if self.supervisor.epoch != self._mu_epoch:
                epoch = self.supervisor.epoch
                self.model_update.reset()
                self._mu_epoch = epoch
            self._update_metrics = self.model_update.push(version)
        except Exception as exc:
            ray.get(self.trainer.stats.remote())  # the trainer gone: its RayActorError (the run stops)
            # the trainer is alive: the engine side failed (died, restarted meanwhile, not in the
            # group): an engine fault -- restart it, form the group again, run the cycle again;
            # after rollout.max_engine_restarts the run stops with this error
            raise EngineFault(f"model-update push of version {version} failed: {exc}") from exc
        self._update_bytes = self._update_metrics["model_update/bytes"]

    def _engine_get_once(self, name: str, *args):
        """One engine call, its faults left to the caller (inside ``supervisor.run``; a hung engine
        is caught by the collector's poll, which kills it, so this call then fails too)."""
        return ray.get(getattr(self.engine, name).remote(*args))

    def _engine_get(self, name: str, *args):
        return self.supervisor.call(name, *args)

    def _write_ledger(self, t: int, groups: list[Group]) -> None:
        """Trained samples, then the scheduler's filtered groups and aborted samples since the last
        step (one line each, with the rule or reason: docs/design.md invariant 5)."""
        outcomes = self.scheduler.drain_outcomes()
        if self.ledger is None:
            return
        for event in outcomes:
            self.ledger.write(json.dumps({**event, "step": t}) + "\n")
        for g in sorted(groups, key=lambda g: g.prompt_id):
            for s in g.samples:
                self.ledger.write(
                    json.dumps(
                        {
                            "prompt_id": g.prompt_id,
                            "data_index": g.data_index,
                            "sample": s.sample_index,
                            "request": s.meta.get("request", s.sample_index),
                            "outcome": "trained",
                            "step": t,
                            "version": s.version,
                            "reward": s.reward,
                            # for `flash plan` (flash.app.plan): response and prompt tokens, how it ended
                            "len": len(s.response_ids),
                            "plen": len(s.prompt_ids),
                            "finish": s.finish_reason,
                            **{k: s.meta[k] for k in LEDGER_META if k in s.meta},
                            **({"facts": s.facts} if s.facts else {}),  # what its agent reported (flash.buffers.facts)
                        }
                    )
                    + "\n"
                )
        self.ledger.flush()

    def _metrics(self, t, samples, batch, prox, train_metrics, step_s) -> dict[str, float]:
        """The step's own metrics (flash.controllers.step_metrics names each source)."""
        return sm.assemble(
            sm.trainer_metrics(train_metrics),
            sm.phase_metrics(self._times, step_s),
            sm.batch_metrics(t, samples, batch),
            sm.facts_metrics(samples),
            sm.rollout_state(len(self.buffer), self.scheduler.admitted),
            self.scheduler.metrics(),  # lifecycle counts, filtered by rule, aborted by reason
            sm.token_metrics(batch, step_s),
            sm.update_metrics(self._update_bytes, self._update_metrics),
            self._mismatch(batch, prox),
            self._role_metrics(step_s),
        )

    def _mismatch(self, batch, prox) -> dict[str, float]:
        """Train–inference mismatch (``flash.algos.mismatch_metrics``) on tokens generated by the current
        weights; none when there are no such tokens.

        (With the fused proximal policy the trainer measures it; it is logged under the same names.)
        """
        if self.s.prox != "separate":
            return {}
        fresh = batch.mask * (batch.versions == self.version - 1).to(batch.mask.dtype)
        metrics = algos.metrics.to_floats(algos.mismatch_metrics(batch.behav_logp, prox, fresh))
        return {f"rollout/{k}": v for k, v in metrics.items()}

    def _start_usage(self) -> None:
        """Open the first idle-ratio window of each role at the start of the first step."""
        self._usage.start(self._engine_get("stats"), ray.get(self.trainer.stats.remote()))

    def _role_metrics(self, step_s: float) -> dict[str, float]:
        """Each role's usage since the previous step (``step_metrics.RoleUsage``); the engine's
        and the environments' busy spans go to the step's timeline."""
        engine, self._engine_spans = self._engine_get("stats"), self._engine_get("busy_spans")
        workflow = getattr(self.scheduler, "workflow", None)
        self._env_spans = workflow.env_spans.drain() if isinstance(workflow, SteppedEnvs) else []
        return self._usage.read(engine, ray.get(self.trainer.stats.remote()), step_s)

    def _timeline(self) -> dict[str, Any]:
        """This step's spans; the trainer is busy in ``recompute_prox`` (when it runs) and ``train``."""
        busy = ["recompute_prox", "train"] if self.s.prox == "separate" else ["train"]
        return {
            "phases": dict(self._spans),
            "engine_busy": self._engine_spans,
            "env_busy": self._env_spans,
            "trainer_busy": [self._spans[p] for p in busy if p in self._spans],
        }

    def shutdown_rollout(self) -> dict[str, list[int]]:
        """Stop admitting, abort training requests in flight; return what was left unfinished."""
        self.scheduler.stop_admission()
        for name, args in (("pause", ("continue",)), ("abort", (None,)), ("resume", ())):
            self._engine_get(name, *args)
        self.scheduler.quiesce()
        pending = self.scheduler.pending_ids()
        buffered = sorted(g.prompt_id for g in self.buffer.drain())
        outcomes = self.scheduler.drain_outcomes()
        if self.ledger is not None:
            for event in outcomes:
                self.ledger.write(json.dumps(event) + "\n")
            for pid in pending:
                self.ledger.write(json.dumps({"prompt_id": pid, "outcome": "in_flight"}) + "\n")
            for pid in buffered:
                self.ledger.write(json.dumps({"prompt_id": pid, "outcome": "buffered"}) + "\n")
            for line in self.scheduler.leftover():  # tail batching's long-prompt queue
                self.ledger.write(json.dumps(line) + "\n")
            self.ledger.flush()
        return {"in_flight": pending, "buffered": buffered}
