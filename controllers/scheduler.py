"""The rollout scheduler core: admits prompts under the staleness bound and turns finished units
into groups, for every workflow (``flash.controllers.workflows``: single-turn, episodes, agent runs).

``RolloutCore`` is composed of parts that each own their state, all guarded by the core's lock:
``admission`` (``flash.controllers.admission``: version, admissions, data position, waves, counted groups
and spares), ``inflight`` (``flash.controllers.inflight``: pending prompts, their units and seeds, outputs
taken, evaluation units) and ``outcomes`` (``flash.controllers.lifecycle``: the lifecycle of every sample,
its ledger events, the run counters). A checkpoint's state is theirs (``state_dict``).

Three kinds of threads, all in the driver:
- *admission*: whenever ``Provisioning`` allows, takes the next prompt and launches its
  ``n + redundancy`` units through the workflow;
- *collector*: pulls outputs from the engine and routes them through the workflow; a unit that
  finished (a response; an episode, handed to ``deliver`` by the thread that ended it) moves on;
  once ``n`` of a prompt's units finished the rest are cancelled (``aborted(redundant)``);
- *reward threads* (``flash.controllers.reward_threads``): turn each finished unit into a scored sample
  as soon as it arrives (queue scheduling) -- or, with ``queue_scheduling=False``, once its admission wave finished generating
  (``WaveGate``). A group's ``n`` scored samples pass the filters (``flash.controllers.filters``) into
  the SampleBuffer, or are filtered and free their slot; a spare's group waits for a slot.
Each runs under ``flash.controllers.thread_errors``: an error in one is re-raised in the controller.

Every sample moves through ``flash.controllers.lifecycle`` (admitted → generating → scoring → buffered |
filtered | aborted → trained), and every admitted prompt is in exactly one place at any time: in
flight here, in the buffer, trained, filtered or aborted -- docs/design.md invariant 5. Request seeds
depend only on (run seed, prompt id, request index), never on timing.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any, Callable

from flash.buffers import Group, SampleBuffer
from .admission import Admission, PromptSource
from .core_state import core_state, restore_core
from .evaluation import evaluate_samples
from .filters import FilterConfig, filter_reason
from .inflight import InFlight, Pending
from .lifecycle import Lifecycle, Outcomes
from .provisioning import WaveGate
from .reward_errors import RewardErrors, score_response
from .reward_threads import RewardThreads
from .staleness import StalenessManager
from .thread_errors import ThreadErrors
from .workflows.base import Service, Unit, Workflow, parse_request_id, request_id, request_seed
from .workflows.single_turn import SingleTurn
from flash.engine.base import GenerationOutput, SamplingParams
from flash.engine.client import EngineClient

__all__ = ["PromptSource", "RolloutCore", "RolloutScheduler", "parse_request_id", "request_id", "request_seed"]


class RolloutCore:
    """The one scheduler: ``workflow`` (a ``Workflow`` and ``Service``) says how a unit runs.

    ``supervisor``: the ``EngineClient`` every engine call goes through (``client``, or a
    pass-through over ``engine``: a fault raises at once)."""

    def __init__(
        self,
        engine,
        workflow: Workflow,
        source: PromptSource,
        buffer: SampleBuffer,
        staleness: StalenessManager,
        params: SamplingParams,
        n: int,
        seed: int,
        reward_workers: int = 4,
        inject_delay_s: float = 0.0,
        start_index: int = 0,
        *,
        queue_scheduling: bool = True,
        redundancy: int = 0,
        max_additional_prompts: int = 0,
        filters: FilterConfig | None = None,
        client: EngineClient | None = None,
        reward_deadline_s: float | None = None,
        reward_errors: RewardErrors | None = None,
    ):
        if redundancy < 0:
            raise ValueError(f"redundancy must be >= 0, got {redundancy}")
        if not isinstance(workflow, Workflow) or not isinstance(workflow, Service):
            raise TypeError(f"{type(workflow).__name__} is not a Workflow (flash.controllers.workflows.base)")
        self.workflow, self.source, self.buffer, self.n = workflow, source, buffer, n
        self.inject_delay_s, self.filters = inject_delay_s, filters or FilterConfig()
        self.reward_deadline_s = reward_deadline_s  # one response's scoring, all its tests (None: none)
        self.reward_errors = reward_errors or RewardErrors()  # each reward's errors in a row, the stop
        self.admission = Admission(staleness, source, max_additional_prompts, start_index)
        self.inflight = InFlight(params, seed, n + int(redundancy))
        self.outcomes = Outcomes()
        self.supervisor = client if client is not None else EngineClient.passthrough(engine)
        self._gate = WaveGate(queue=queue_scheduling)
        self._rng = random.Random(seed + 17)
        self._lock = threading.Condition()
        # Engine submits and aborts are ordered: admission takes this lock before it releases ``_lock``,
        # so an abort decided after a prompt was admitted reaches the engine after its requests did
        # (else the abort would miss them and they would run to the end, unused).
        self._engine_io = threading.Lock()
        self._stop = threading.Event()
        self._polls = 0  # collector polls
        self._errors = ThreadErrors(lambda: self.buffer.wake())
        self._rewards = RewardThreads(self._lock, reward_workers, self._guard)  # responses not yet filed: busy
        self._later_aborts: list[str] = []  # unit ids a subclass's _group_done decided to cancel
        self._threads = [
            threading.Thread(target=self._guard(f), daemon=True, name=f.__name__)
            for f in (self._admit_loop, self._collect_loop)
        ]
        # last: the workflow may read the core's state (counters) when bound. The ignore: every
        # workflow has a ``core``; the Workflow protocol leaves it out, so isinstance above needs none
        workflow.core = self  # type: ignore[attr-defined]

    @property
    def counters(self) -> dict[str, float]:  # the run counters (``Outcomes``), shared with the workflow
        return self.outcomes.counters

    @property
    def lifecycle(self) -> Lifecycle:  # the samples' lifecycle (``Outcomes``)
        return self.outcomes.lifecycle

    # ---- controller-facing API -------------------------------------------------------------
    def start(self) -> None:
        """Start collecting (evaluation works from here on); admission starts separately."""
        self._threads[1].start()

    def start_admission(self) -> None:
        self._threads[0].start()

    def set_version(self, version: int) -> None:
        """The policy moved to ``version``: more prompts may be admitted; older spares end."""
        with self._lock:
            abort_ids = []
            for pid in self.admission.move_to(version):  # older spares
                abort_ids += self._drop_prompt(pid, self.expire_reason, {})
            self._on_version(version)
            self._lock.notify_all()
        self._abort(abort_ids)
        self.buffer.wake()

    def pending_versions(self) -> list[int]:
        """Admission versions of trainable groups not yet complete (spares excluded)."""
        with self._lock:
            return [p.version for pid, p in self.inflight.prompts.items() if not self.admission.prov.is_spare(pid)]

    def pending_ids(self) -> list[int]:
        with self._lock:
            return sorted(self.inflight.prompts)

    @property
    def admitted(self) -> int:
        with self._lock:
            return self.admission.admitted

    def mark_trained(self, groups: list[Group]) -> None:
        self.lifecycle.move([s.meta["request_id"] for g in groups for s in g.samples], "trained")

    def drain_outcomes(self) -> list[dict]:
        """Ledger events of filtered groups and aborted samples since the last call."""
        return self.lifecycle.drain_events()

    def metrics(self) -> dict[str, float]:
        """The outcomes' metrics (``Outcomes.metrics``), the counted admissions, the workflow's."""
        with self._lock:
            m = self.outcomes.metrics()
            m.update(self.reward_errors.metrics())
            m["rollout/counted_admissions"] = float(self.admission.prov.counted)
        m.update(self.workflow.metrics())
        return m

    def leftover(self) -> list[dict]:
        """Ledger lines for prompts still queued outside the core at the end of a run (none here)."""
        return []

    def check(self) -> None:
        """Re-raise an error from a scheduler thread in the caller."""
        self._errors.check()

    def stop_admission(self) -> None:
        with self._lock:
            self.admission.stopped.set()
            self._lock.notify_all()

    def quiesce(self, timeout: float = 60.0) -> None:
        """Wait until the collector has polled twice more and every response taken is filed."""
        with self._lock:
            polls = self._polls
            ok = self._lock.wait_for(
                lambda: self._errors.error is not None or (self._polls >= polls + 2 and self._rewards.busy == 0),
                timeout,
            )
        self.check()
        if not ok:
            raise TimeoutError("rollout scheduler did not quiesce")

    def stop(self) -> None:
        self.admission.stopped.set()
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=10)
        self.workflow.stop()
        self._rewards.shutdown()

    def evaluate(self, items: list, params: SamplingParams, tag: str, seed: int) -> list[float]:
        """The rewards of ``evaluate_samples``, in item order."""
        return [s.reward for s in self.evaluate_samples(items, params, tag, seed)]

    def evaluate_samples(
        self,
        items: list,
        params: SamplingParams,
        tag: str,
        seed: int,
        on_progress: Callable[[int], None] | None = None,
        on_scored: Callable[[int], None] | None = None,
    ) -> list:
        """One unit per item through the same engine; the scored samples in item order
        (``flash.controllers.evaluation.evaluate_samples``: ``on_progress``, ``on_scored``)."""
        return evaluate_samples(self, items, params, tag, seed, on_progress, on_scored)

    # ---- checkpoint and fault hooks (flash.checkpoint, flash.engine.client) ---------------------
    def state_dict(self) -> dict:
        """The parts' state (admission, outcomes, the prompts in flight) and the RNG
        (``flash.controllers.core_state``: a prompt in flight restarts from scratch on resume)."""
        return core_state(self)

    def load_state_dict(self, state: dict, buffered_groups: list[Group] | None = None) -> int:
        """Restore a checkpoint's state before ``start`` (``flash.controllers.core_state.restore_core``:
        the buffer's groups already put back); returns how many prompts restarted."""
        return restore_core(self, state, buffered_groups)

    def requeue_lost(self, ids: list[str] | None = None) -> int:
        """After an engine restart: ask again what the engine lost (``InFlight.lost``; of ``ids``
        only when given: the requests a restarted replica behind a router held) through
        ``Workflow.requeue``. Returns how many. Called inside the engine client's recovery, maybe
        from a thread that holds ``_engine_io``: it launches without that lock (an abort racing a
        recovery at worst lets a request run on)."""
        only = None if ids is None else set(ids)
        with self._lock:
            lost = self.inflight.lost(lambda rid: self.lifecycle.state(rid) == "generating", self.source.encode, only)
        return self.workflow.requeue(lost, ids)

    # ---- threads -------------------------------------------------------------------------
    def _guard(self, fn):
        """``fn`` as a thread's target, its error kept for ``check`` (``ThreadErrors.guard``)."""
        return self._errors.guard(fn)

    # ---- admission (the admission thread; hooks under the lock) --------------------------------
    def _admit_loop(self) -> None:
        adm = self.admission
        while not adm.stopped.is_set():
            with self._lock:
                self._lock.wait_for(lambda: adm.stopped.is_set() or adm.next_action() is not None)
                if adm.stopped.is_set():
                    return
                batch, promoted = self._admit_wave()
                self._engine_io.acquire()
            try:
                self.workflow.launch(batch)
            finally:
                self._engine_io.release()
            for pid, group in promoted:
                self._to_buffer(pid, group)

    def _admit_wave(self) -> tuple[list[Unit], list[tuple[int, Group]]]:
        """Everything admission allows now (under the lock): promotions first, then new prompts."""
        wave = self.admission.new_wave()
        batch, promoted = [], []
        while (action := self.admission.next_action()) is not None:
            kind, pid = action
            if kind == "promote":
                assert pid is not None  # a promotion names its spare
                self.admission.prov.promote(pid)
                group = self.inflight.prompts[pid].parked
                if group is not None:  # already scored and kept: straight to the buffer
                    self.lifecycle.move([s.meta["request_id"] for s in group.samples], "buffered")
                    promoted.append((pid, group))
            else:
                batch.extend(self._admit_one(wave, spare=kind == "spare"))
        self._gate.open(wave, len(batch))
        return batch, promoted

    def _admit_one(self, wave: int, spare: bool) -> list[Unit]:
        """Admit the next prompt (``_take_prompt``) under a new prompt id; its units."""
        index, item, ids, cap, meta = self._take_prompt(spare)
        version, prompt_id = self.admission.version, self.admission.new_prompt(spare)
        self.inflight.open(prompt_id, item, index, version, wave, cap, meta)
        return self._start_units(prompt_id, ids, range(self.inflight.requests))

    def _start_units(self, prompt_id: int, ids: list[int], ks) -> list[Unit]:
        """Units ``ks`` of pending prompt ``prompt_id``, admitted and generating in the lifecycle."""
        units = self.inflight.units(prompt_id, ids, ks)
        rids = [u.id for u in units]
        self.lifecycle.admit(rids)
        self.lifecycle.move(rids, "generating")
        return units

    def _take_prompt(self, spare: bool) -> tuple[int, Any, list[int], int | None, dict]:
        """The next prompt to admit: (data index, item, token ids, length cap or None, sample meta)."""
        index, item, ids = self.admission.take()
        return index, item, ids, None, {}

    def _on_version(self, version: int) -> None:
        """Hook under the lock when the policy moved to ``version``, before admission goes on."""

    expire_reason = "surplus"  # why an expired spare ends (rollout/aborted/<reason>)

    def _drop_prompt(self, pid: int, reason: str, event: dict) -> list[str]:
        """End every live request of pending prompt ``pid`` as aborted(reason), one ledger event for
        the prompt (under the lock); returns the ids still generating, to abort in the engine."""
        p = self.inflight.prompts.pop(pid)
        rids = [request_id(pid, j) for j in range(p.requests)]
        states = {r: self.lifecycle.state(r) for r in rids}
        live = [r for r in rids if states[r] is not None]
        generating = [r for r in live if states[r] == "generating"]
        self.lifecycle.abort(
            live, reason, [{"prompt_id": pid, "data_index": p.data_index, "samples": len(live), **event}]
        )
        self._dispatch(self._gate.resolved(p.wave, len(generating)))
        return generating

    # ---- collection and scoring (the collector and reward threads) -----------------------------
    def _collect_loop(self) -> None:
        while not self._stop.is_set():
            self.deliver(self.workflow.route(self.supervisor.poll(0.2)))
            with self._lock:
                self._polls += 1
                self._lock.notify_all()

    def deliver(self, outs: list[GenerationOutput]) -> None:
        """Units that finished (from the collector, or from the thread that ended an episode):
        evaluations are answered, training units move on to scoring. An output for a unit already
        taken (asked again around an engine restart) or of a prompt no longer pending is dropped
        and counted (``duplicate_outputs``)."""
        to_abort: list[str] = []
        with self._lock:
            for out in outs:
                rid = out.request_id
                if rid.startswith("eval/"):
                    self.inflight.answers[rid] = out
                elif out.finish_reason != "abort":  # partials of an abort are not results
                    if not self.inflight.first_output(rid):
                        self.counters["duplicate_outputs"] = self.counters.get("duplicate_outputs", 0) + 1
                        continue
                    self._dispatch(self._on_generated(out, to_abort))
            if self._polls % 50 == 0:
                self.inflight.forget_ended()
            self._lock.notify_all()
        self._abort(to_abort)

    def _abort(self, ids: list[str]) -> None:
        """Cancel units ``ids`` (never under ``_lock``): engine requests aborted, environments
        released. Their partial work is dropped: the lifecycle already counted them as aborted."""
        if ids:
            with self._engine_io:
                self.workflow.cancel(ids)

    def _on_generated(self, out: GenerationOutput, to_abort: list[str]) -> list[GenerationOutput]:
        """A response finished generating (under the lock); returns outputs ready for scoring."""
        rid = out.request_id
        if self.lifecycle.state(rid) != "generating":  # aborted (redundant / surplus) meanwhile
            self.counters["late_outputs"] += 1
            return []
        pid, k = parse_request_id(rid)
        p = self.inflight.prompts[pid]
        if out.finish_reason == "error":  # refused by the engine: scores 0, counted
            self.counters["request_errors"] += 1
        self.counters["samples_generated"] += 1
        self.counters["tokens_generated"] += len(out.token_ids)
        p.finished.append(k)
        self.lifecycle.move([rid], "scoring")
        ready = self._gate.finished(p.wave, out)
        if len(p.finished) == self.n and p.requests > self.n:
            # still generating (after a restore, requests that had ended before the checkpoint are gone)
            rest = [
                request_id(pid, j)
                for j in range(p.requests)
                if j not in p.finished and self.lifecycle.state(request_id(pid, j)) == "generating"
            ]
            self.lifecycle.abort(
                rest, "redundant", [{"prompt_id": pid, "request": parse_request_id(r)[1]} for r in rest]
            )
            to_abort.extend(rest)
            ready += self._gate.resolved(p.wave, len(rest))
        return ready

    def _dispatch(self, outs: list[GenerationOutput]) -> None:
        """Hand responses to the reward threads (under the lock)."""
        for out in outs:
            # the ignore: mypy cannot type a defaulted lambda (``o=out`` binds this output)
            self._rewards.submit(lambda o=out: self._finish_sample(o))  # type: ignore[misc]

    def _finish_sample(self, out: GenerationOutput) -> None:
        pid, k = parse_request_id(out.request_id)
        with self._lock:
            pending = self.inflight.prompts.get(pid)
            if pending is None or self.lifecycle.state(out.request_id) != "scoring":
                return  # its group was aborted (surplus) while the response waited
            unit = self.inflight.units(pid, [], [k])[0]
        start = time.monotonic()
        if self.inject_delay_s > 0:  # a slow reward, for tests and benchmarks
            time.sleep(self._rng.uniform(0, self.inject_delay_s))
        sample = self.workflow.finish(unit, out)
        with self._lock:
            self.counters["reward_seconds"] += time.monotonic() - start
            if self.inflight.prompts.get(pid) is not pending or self.lifecycle.state(out.request_id) != "scoring":
                return
            pending.samples[k] = sample
            if len(pending.samples) < self.n:
                return
            group = pending.group(pid)
            to_buffer = self._group_done(pid, pending, group)
        if to_buffer:
            self._to_buffer(pid, group)
        else:
            self.buffer.wake()  # a filtered group left the pending versions
        with self._lock:
            later, self._later_aborts = self._later_aborts, []
        self._abort(later)

    def _group_done(self, pid: int, p: Pending, group: Group) -> bool:
        """Filter, park (a spare) or send to the buffer (under the lock); True: put it in the buffer."""
        rids = [s.meta["request_id"] for s in group.samples]
        rule = None
        if self.filters.enabled:
            rule = filter_reason(group.rewards, [len(s.response_ids) for s in group.samples], self.filters)
        if rule is not None:
            self.lifecycle.filter_group(
                rids,
                rule,
                {"prompt_id": pid, "data_index": p.data_index, "version": group.version, "rewards": group.rewards},
            )
            self.admission.prov.filtered(pid)
            del self.inflight.prompts[pid]
            self._lock.notify_all()  # a slot (or a spare's place) is free
            return False
        if self.admission.prov.is_spare(pid):
            p.parked = group
            self.admission.prov.spare_finished(pid)
            self._lock.notify_all()
            return False
        self.lifecycle.move(rids, "buffered")
        return True

    def _to_buffer(self, pid: int, group: Group) -> None:
        self.buffer.put(group)  # in the buffer before it leaves pending: never in neither
        with self._lock:
            del self.inflight.prompts[pid]
        self.buffer.wake()

    def score(self, item, token_ids: list[int], training: bool = True) -> float:
        """Reward of one response (``flash.controllers.reward_errors.score_response``: a reward that fails
        scores 0 and is counted; one failing on every training response stops the run)."""
        return score_response(self, item, token_ids, training)


class RolloutScheduler(RolloutCore):
    """The core running the single-turn workflow (``flash.controllers.workflows.single_turn``)."""

    def __init__(
        self,
        engine,
        source: PromptSource,
        buffer: SampleBuffer,
        staleness: StalenessManager,
        params: SamplingParams,
        n: int,
        seed: int,
        *args,
        **kwargs,
    ):
        super().__init__(engine, SingleTurn(), source, buffer, staleness, params, n, seed, *args, **kwargs)
