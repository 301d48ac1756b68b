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
from algos.proximal import prox_approx_error
from buffers import Group, SampleBuffer
from controllers.scheduler import RolloutCore
from controllers.staleness import StalenessManager
from controllers.workflows.base import SteppedEnvs
from flash.engine.client import EngineClient, EngineFault
from flash.train.batch import TrainBatch, collate, flatten
from flash.usage import IdleMeter

# sample meta copied into a trained sample's ledger line when present (tail batching's rounds)
LEDGER_META = ("round", "cut_from")
PHASES = ("get_batch", "recompute_prox", "advantages", "train", "suspend", "push_weights", "resume")


@dataclass
class ControllerSettings:
    prompts_per_step: int
    interrupt: str
    advantage: dict[str, Any]
    # "behav" (prox = behaviour), "fused" (in the train forward), "separate" (own phase),
    # "approx" (interpolated in the train forward, algos.proximal)
    prox: str
    pad_id: int = 0
    stream: bool = False  # stream trainer: backward each group on arrival (async_ratio 0 only)
    # The engines share the trainer's devices (flash.placement): they are paused and put to sleep
    # (memory released) before the trainer runs, and woken before the weight push.
    colocated: bool = False
    # with prox "approx": run the real recompute too and report rollout/prox_approx_error
    measure_prox_error: bool = False


@dataclass
class StepRecord:
    step: int
    metrics: dict[str, float]
    groups: list[Group] = field(default_factory=list)
    # Wall-clock (time.time()) spans for the run's timeline: each phase, the engine's busy spans
    # since the previous step, and the trainer's busy phases (flash.usage, `flash plot`).
    timeline: dict[str, Any] = field(default_factory=dict)


class AsyncController:
    def __init__(self, engine, trainer, scheduler: RolloutCore, buffer: SampleBuffer,
                 staleness: StalenessManager, settings: ControllerSettings, ledger=None, critic=None,
                 model_update=None, supervisor: EngineClient | None = None, reference=None):
        self.engine, self.trainer, self.critic = engine, trainer, critic
        # the placed reference role (flash.train.reference) for a KL penalty; None: the trainer's copy
        self.reference = reference
        self.scheduler, self.buffer, self.staleness = scheduler, buffer, staleness
        self.s = settings
        self.ledger = ledger
        self.version = 0
        self._times: dict[str, float] = {}
        self._spans: dict[str, list[float]] = {}
        self._engine_prev: dict[str, float] = {}
        self._trainer_prev = 0.0
        self._engine_spans: list[list[float]] = []
        self._env_spans: list[list[float]] = []  # environment steps in flight (episode workflows)
        self._meters = {"rollout": IdleMeter(), "train": IdleMeter()}
        self._update_bytes = 0.0
        self._reward_cpu_prev = 0.0  # the reward pool's CPU seconds at the previous step
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
        if self.s.stream:
            return self._stream_step(t, admit_more, start)
        with self.phase("get_batch"):
            groups = self._get_batch(t)
        samples = flatten(groups)
        batch = collate(samples, pad_id=self.s.pad_id)
        ref_call = reference_call(self.reference, batch)  # overlaps the prox and advantages below
        if self.s.colocated:
            with self.phase("sleep"):
                self._engine_get("pause", self.s.interrupt)
                self._engine_get("sleep")
        with self.phase("recompute_prox"):
            prox = proximal(self.s.prox, batch, self.trainer)
            approx_error = self._approx_error(batch, t)
        with self.phase("advantages"):
            adv, critic_step = advantages(self.s.advantage, batch, self.critic)
        ref = self._reference_wait(ref_call)
        with self.phase("train"):
            train_metrics = ray.get(self.trainer.train_step.remote(batch, adv, prox, ref))
            if critic_step is not None:  # the critic trained beside the policy
                train_metrics.update(ray.get(critic_step))
        if self.s.colocated:  # still paused: the weight push below finds the weights on the device
            with self.phase("wake_up"):
                self._engine_get("wake_up")
        self._after_train(t, groups, admit_more)
        metrics = self._metrics(t, samples, batch, prox, train_metrics, time.monotonic() - start)
        metrics.update(approx_error)
        return StepRecord(step=t, metrics=metrics, groups=groups, timeline=self._timeline())

    def _reference_wait(self, call):
        """The reference role's logprobs (None without one); the wait is the ``reference`` phase."""
        if call is None:
            return None
        with self.phase("reference"):
            return ray.get(call)

    def _approx_error(self, batch: TrainBatch, t: int) -> dict[str, float]:
        """``algo.measure_prox_error``: the real recompute beside the approximation; their mean
        absolute difference over the batch's tokens (the approximation at the batch's first step)."""
        if not self.s.measure_prox_error or self.s.prox != "approx":
            return {}
        recomputed = ray.get(self.trainer.logprobs.remote(batch))
        return {"rollout/prox_approx_error": prox_approx_error(
            batch.behav_logp, recomputed, batch.versions, batch.mask, t)}

    def _stream_step(self, t: int, admit_more: bool, start: float) -> StepRecord:
        """The stream trainer (RollPacker): each group is backpropagated as soon as it is in the
        buffer, while the rest of the batch still decodes; the optimizer steps once the batch is
        complete. ``Trainer.accumulate`` weights each part by what it stands for in the batch's
        aggregate, so the update equals the plain step on the whole batch (up to float summation
        order). Validation keeps it to async_ratio 0 and group-local estimators, where a group's
        advantages and proximal policy (= behaviour) are final when the group is.

        Timeline: ``get_batch`` spans the streaming (the trainer works inside it, one group behind
        the rollout); ``train`` is the tail after the last group (its backward and the step).
        """
        ray.get(self.trainer.begin_step.remote())
        groups, pending = [], None
        with self.phase("get_batch"):
            while len(groups) < self.s.prompts_per_step:
                group = self._next_group()
                part = collate(flatten(group), pad_id=self.s.pad_id)
                adv, _ = advantages(self.s.advantage, part, self.critic)
                if pending is not None:
                    ray.get(pending)  # keep one part in flight: the actor runs them in order
                ref = self._reference_wait(reference_call(self.reference, part))
                pending = self.trainer.accumulate.remote(part, adv, part.behav_logp, ref)
                groups += group
        with self.phase("train"):
            ray.get(pending)
            train_metrics = ray.get(self.trainer.finish_step.remote())
        samples = flatten(groups)
        batch = collate(samples, pad_id=self.s.pad_id)
        self._after_train(t, groups, admit_more)
        metrics = self._metrics(t, samples, batch, batch.behav_logp, train_metrics, time.monotonic() - start)
        return StepRecord(step=t, metrics=metrics, groups=groups, timeline=self._timeline())

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
        """Any one finished group (at async_ratio 0 every buffered group is of this step)."""
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
            self.supervisor.pushed(weights if weights is not None else self.trainer.get_weights.remote,
                                   new_version)

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
        step (one line each, with the rule or reason: DESIGN.md invariant 5)."""
        outcomes = self.scheduler.drain_outcomes()
        if self.ledger is None:
            return
        for event in outcomes:
            self.ledger.write(json.dumps({**event, "step": t}) + "\n")
        for g in sorted(groups, key=lambda g: g.prompt_id):
            for s in g.samples:
                self.ledger.write(json.dumps({
                    "prompt_id": g.prompt_id, "data_index": g.data_index, "sample": s.sample_index,
                    "request": s.meta.get("request", s.sample_index), "outcome": "trained", "step": t,
                    "version": s.version, "reward": s.reward,
                    # for `flash plan` (flash.app.plan): response and prompt tokens, how it ended
                    "len": len(s.response_ids), "plen": len(s.prompt_ids), "finish": s.finish_reason,
                    **{k: s.meta[k] for k in LEDGER_META if k in s.meta},
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
        m.update(self.scheduler.metrics())  # lifecycle counts, filtered by rule, aborted by reason
        if "reward/cpu_s" in m:  # the reward pool's CPU seconds since it started -> this step's
            total = m["reward/cpu_s"]  # (a replaced or retired worker's count leaves the sum: >= 0)
            m["reward/cpu_s"] = max(0.0, total - self._reward_cpu_prev)
            self._reward_cpu_prev = total
        m.update({f"staleness/count_{k}": float(stale.count(k)) for k in range(max(stale) + 1)})
        tokens = float(batch.mask.sum())
        m.update({"train/batch_tokens": tokens, "train/tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
                  "rollout/update_bytes": self._update_bytes})
        m.update(self._update_metrics)
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
        self._engine_prev, self._trainer_prev = engine, trainer.get("busy_s", 0.0)
        self._cpu_prev = {"train": trainer.get("cpu_s", 0.0), "driver": time.process_time()}
        self._meters["rollout"].start(engine.get("busy_s", 0.0))
        self._meters["train"].start(trainer.get("busy_s", 0.0))

    def _role_metrics(self, step_s: float) -> dict[str, float]:
        """Idle ratio per role (``1 − Δbusy/Δwall`` since the previous step's read, so time spent
        between steps -- evaluation, logging -- counts too) and generated tokens/s."""
        engine, self._engine_spans = self._engine_get("stats"), self._engine_get("busy_spans")
        workflow = getattr(self.scheduler, "workflow", None)
        self._env_spans = workflow.env_spans.drain() if isinstance(workflow, SteppedEnvs) else []
        trainer = ray.get(self.trainer.stats.remote())
        prev, self._engine_prev = self._engine_prev, engine
        self._trainer_prev, trainer_prev = trainer.get("busy_s", 0.0), self._trainer_prev
        # a restarted engine counts from zero again: its tokens since the restart, not a negative delta
        tokens = engine.get("tokens_generated", 0.0) - prev.get("tokens_generated", 0.0)
        tokens = tokens if tokens >= 0 else engine.get("tokens_generated", 0.0)
        delta = {k: max(0.0, engine.get(k, 0.0) - prev.get(k, 0.0))
                 for k in ("busy_s", "decode_steps", "cpu_s", "sim_late_s")}
        cpu = {"train": trainer.get("cpu_s", 0.0), "driver": time.process_time()}
        cpu_prev, self._cpu_prev = self._cpu_prev, cpu
        return {
            # CPU seconds per step of each role's processes (engine: its tree, e.g. vLLM's core; the
            # driver: the controller's process alone): what bounds an overlapped step on shared cores
            "rollout/cpu_s": delta["cpu_s"], "train/cpu_s": max(0.0, cpu["train"] - cpu_prev["train"]),
            "driver/cpu_s": max(0.0, cpu["driver"] - cpu_prev["driver"]),
            # per-step deltas for `flash plan` (flash.app.plan): engine busy seconds, decode iterations,
            # trainer busy seconds
            "rollout/busy_s": delta["busy_s"], "rollout/decode_steps": delta["decode_steps"],
            "train/busy_s": max(0.0, trainer.get("busy_s", 0.0) - trainer_prev),
            "rollout/idle_ratio": self._meters["rollout"].read(engine.get("busy_s", 0.0)),
            "train/idle_ratio": self._meters["train"].read(trainer.get("busy_s", 0.0)),
            "rollout/tokens_generated": tokens,
            "rollout/tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
            # a simulated engine: real seconds its bookkeeping ran past the scaled GPU time
            **({"rollout/sim_late_s": delta["sim_late_s"]} if "sim_late_s" in engine else {}),
        }

    def _timeline(self) -> dict[str, Any]:
        """This step's spans; the trainer is busy in ``recompute_prox`` (when it runs) and ``train``."""
        busy = ["recompute_prox", "train"] if self.s.prox == "separate" else ["train"]
        return {"phases": dict(self._spans), "engine_busy": self._engine_spans, "env_busy": self._env_spans,
                "trainer_busy": [self._spans[p] for p in busy if p in self._spans]}

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


def proximal(mode: str, batch: TrainBatch, trainer):
    """The proximal logprobs of a step under ``mode`` (``prox_mode``): behaviour's, None (fused
    into the train forward, or approximated there: the trainer's ``settings.prox`` says which) or
    the trainer's current ones from a forward of their own."""
    if mode == "separate":
        return ray.get(trainer.logprobs.remote(batch))
    return {"behav": batch.behav_logp, "fused": None, "approx": None}[mode]


def reference_call(reference, batch: TrainBatch):
    """The reference role's logprobs of ``batch``, asked for now and awaited later (None without
    one: the trainer's local copy, if any, serves the KL penalty)."""
    return None if reference is None else reference.logprobs.remote(batch)


def advantages(advantage: dict[str, Any], batch: TrainBatch, critic=None):
    """(advantages, the critic's train step or None) from the configured estimator; with a critic
    (``gae``) its values come first and its own train step is launched at once (it needs only
    the batch, values and returns). The replay of a run (flash.app.replay) calls it too."""
    knobs = {k: v for k, v in advantage.items() if k != "name"}
    values = critic_step = None
    if critic is not None:
        values = ray.get(critic.values.remote(batch))
        returns = algos.gae_returns(batch.rewards, values, batch.mask,
                                    knobs.get("gamma", 1.0), knobs.get("lam", 1.0))
        critic_step = critic.train_step.remote(batch, returns, values)
    adv = algos.compute_advantages(advantage["name"], batch.rewards, batch.group_ids, batch.mask,
                                   values=values, **knobs)
    return adv, critic_step


def prox_mode(mode: str, async_ratio: float) -> str:
    """Where the proximal logprobs come from, for the config's ``algo.recompute_prox``.

    ``auto``: at r = 0 every sample is on-policy and prox equals behav (up to the train–inference
    mismatch), so behav is used, exactly as a plain synchronous loop does; at r > 0 the recompute
    is fused into the train forward (exact with one optimizer step per batch, one forward saved).
    ``always``: a separate forward before the step (its own timed phase). ``never``: behav.
    ``approx``: AReaL's interpolation between behav and the current policy by token version, in the
    train forward (``algos.proximal``; no recompute at all).
    """
    if mode == "auto":
        return "fused" if async_ratio > 0 else "behav"
    return {"always": "separate", "approx": "approx"}.get(mode, "behav")

