"""The rollout scheduler core: admits prompts under the staleness bound and turns finished units
into groups, for every workflow (``controllers.workflows``: single-turn requests, environment
episodes).

Three kinds of threads, all in the driver:
- *admission* (``controllers.admission.Admission``, this class's base): whenever ``Provisioning``
  allows, takes the next prompt and launches its ``n + redundancy`` units through the workflow;
- *collector*: pulls outputs from the engine and routes them through the workflow; a unit that
  finished (a response; an episode, handed to ``deliver`` by the thread that ended it) moves on,
  and once ``n`` of a prompt's units finished the redundant rest are cancelled
  (``aborted(redundant)``: engine requests aborted, environments released);
- *reward pool*: turns each finished unit into a scored sample as soon as it arrives (queue
  scheduling), concurrently with generation -- or, with ``queue_scheduling=False``, only once its
  admission wave has finished generating (``WaveGate``). A group's ``n`` scored samples then pass
  the dynamic-sampling filters (``controllers.filters``) into the SampleBuffer, or are filtered and
  free their slot; a spare's group waits for a slot (``controllers.provisioning``).

Every sample moves through ``controllers.lifecycle`` (admitted → generating → scoring → buffered |
filtered | aborted → trained), and every admitted prompt is in exactly one place at any time: in
flight here, in the buffer, trained, filtered or aborted -- DESIGN.md invariant 5. Request seeds
depend only on (run seed, prompt id, request index), never on timing.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from buffers import BufferClosed, Group, SampleBuffer
from buffers.reward import reward_value
from controllers.admission import Admission, PromptSource, _Pending
from controllers.filters import RULES, FilterConfig, filter_reason
from controllers.lifecycle import Lifecycle
from controllers.provisioning import Provisioning, WaveGate
from controllers.staleness import StalenessManager
from controllers.workflows.base import Hold, Unit, Workflow, parse_request_id, request_id, request_seed
from controllers.workflows.single_turn import SingleTurn
from flash.engine.base import GenerationOutput, SamplingParams
from flash.engine.client import EngineClient
from flash.errors import FlashError

__all__ = ["PromptSource", "RolloutCore", "RolloutScheduler", "parse_request_id", "request_id", "request_seed"]

ABORT_REASONS = ("redundant", "surplus")  # why a sample ends aborted (rollout/aborted/<reason>)


class RolloutCore(Admission):
    """The one scheduler: ``workflow`` (a ``Workflow`` and ``Hold``) says how a unit runs.

    ``supervisor``: the ``EngineClient`` every engine call goes through (``client``, or a
    pass-through over ``engine``: a fault raises at once)."""

    def __init__(self, engine, workflow: Workflow, source: PromptSource, buffer: SampleBuffer,
                 staleness: StalenessManager, params: SamplingParams, n: int, seed: int,
                 reward_workers: int = 4, inject_delay_s: float = 0.0, start_index: int = 0, *,
                 queue_scheduling: bool = True, redundancy: int = 0, max_additional_prompts: int = 0,
                 filters: FilterConfig | None = None, client: EngineClient | None = None):
        if redundancy < 0:
            raise ValueError(f"redundancy must be >= 0, got {redundancy}")
        if not isinstance(workflow, Workflow) or not isinstance(workflow, Hold):
            raise TypeError(f"{type(workflow).__name__} is not a Workflow (controllers.workflows.base)")
        self.workflow = workflow
        self.engine, self.source, self.buffer = engine, source, buffer
        self.staleness, self.params, self.n, self.seed = staleness, params, n, seed
        self.inject_delay_s, self.redundancy = inject_delay_s, int(redundancy)
        self.filters = filters or FilterConfig()
        self.lifecycle = Lifecycle()
        self._prov = Provisioning(staleness, max_additional_prompts)
        self._gate = WaveGate(queue=queue_scheduling)
        self._rng = random.Random(seed + 17)
        self._lock = threading.Condition()
        # Engine submits and aborts are ordered: admission takes this lock before it releases
        # ``_lock``, so an abort decided after a prompt was admitted reaches the engine after its
        # requests did (else the abort would miss them and they would run to the end, unused).
        self._engine_io = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._admitted = 0
        self._waves = 0
        self._next_index = start_index
        self._version = 0
        self._stop = threading.Event()
        self._admit_stop = threading.Event()
        self._scoring = 0  # responses handed to the reward pool and not yet filed
        self._polls = 0  # collector iterations, for quiesce()
        self._error: BaseException | None = None
        self._eval: dict[str, GenerationOutput] = {}
        self._pool = ThreadPoolExecutor(max_workers=max(1, reward_workers), thread_name_prefix="reward")
        # late_outputs: a finished response of a request already aborted (it raced the abort)
        self.counters = {"samples_generated": 0, "tokens_generated": 0, "reward_errors": 0,
                         "request_errors": 0, "late_outputs": 0, "reward_seconds": 0.0}
        self.supervisor = client if client is not None else EngineClient.passthrough(engine)
        self._later_aborts: list[str] = []  # unit ids a subclass's _group_done decided to cancel
        self._received: set[str] = set()  # unit ids finished for pending prompts
        self._eval_units: dict[str, Unit] = {}  # evaluation units not yet answered
        self._threads = [threading.Thread(target=self._guard(f), daemon=True, name=f.__name__)
                         for f in (self._admit_loop, self._collect_loop)]
        workflow.core = self  # last: the workflow may read the core's state (counters) when bound

    # ---- controller-facing API -------------------------------------------------------------
    def start(self) -> None:
        """Start collecting (evaluation works from here on); admission starts separately."""
        self._threads[1].start()

    def start_admission(self) -> None:
        self._threads[0].start()

    def pending_versions(self) -> list[int]:
        """Admission versions of trainable groups not yet complete (spares excluded)."""
        with self._lock:
            return [p.version for pid, p in self._pending.items() if not self._prov.is_spare(pid)]

    def pending_ids(self) -> list[int]:
        with self._lock:
            return sorted(self._pending)

    @property
    def admitted(self) -> int:
        with self._lock:
            return self._admitted

    def mark_trained(self, groups: list[Group]) -> None:
        self.lifecycle.move([s.meta["request_id"] for g in groups for s in g.samples], "trained")

    def drain_outcomes(self) -> list[dict]:
        """Ledger events of filtered groups and aborted samples since the last call."""
        return self.lifecycle.drain_events()

    def metrics(self) -> dict[str, float]:
        """Lifecycle counts, filtered groups by rule, aborted samples by reason (every rule and
        reason present, zero until it happens, so a tracker's series start at step 1)."""
        m = {f"rollout/filtered/{rule}": 0.0 for rule in RULES}
        m.update({f"rollout/aborted/{reason}": 0.0 for reason in ABORT_REASONS})
        m.update(self.lifecycle.metrics())
        with self._lock:
            m.update({"rollout/late_outputs": float(self.counters["late_outputs"]),
                      "reward/seconds_total": float(self.counters["reward_seconds"]),
                      "rollout/counted_admissions": float(self._prov.counted)})
        m.update(self.workflow.metrics())
        return m

    def suspend(self, timeout: float = 120.0) -> float:
        """Around a weight update: the workflow holds back what may not run across it (environment
        steps); returns the seconds it waited."""
        waited = self.workflow.suspend(timeout)
        self.check()
        return waited

    def resume(self) -> None:
        self.workflow.resume()

    def leftover(self) -> list[dict]:
        """Ledger lines for prompts still queued outside the core at the end of a run (none here)."""
        return []

    def check(self) -> None:
        """Re-raise an error from a scheduler thread in the caller."""
        if self._error is not None:
            raise RuntimeError(f"rollout scheduler failed: {self._error!r}") from self._error

    def stop_admission(self) -> None:
        with self._lock:
            self._admit_stop.set()
            self._lock.notify_all()

    def quiesce(self, timeout: float = 60.0) -> None:
        """Wait until the collector has polled twice more and every response taken is filed."""
        with self._lock:
            polls = self._polls
            ok = self._lock.wait_for(lambda: self._error is not None or
                                     (self._polls >= polls + 2 and self._scoring == 0), timeout)
        self.check()
        if not ok:
            raise TimeoutError("rollout scheduler did not quiesce")

    def stop(self) -> None:
        self._admit_stop.set()
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=10)
        self.workflow.stop()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def evaluate(self, items: list, params: SamplingParams, tag: str, seed: int) -> list[float]:
        """The rewards of ``evaluate_samples``, in item order."""
        return [s.reward for s in self.evaluate_samples(items, params, tag, seed)]

    def evaluate_samples(self, items: list, params: SamplingParams, tag: str, seed: int) -> list:
        """One unit per item (a response, an episode) through the same engine; the scored samples
        in item order, scored concurrently on the reward threads."""
        units = [Unit(f"eval/{tag}/{i}", -1, i, item, self.source.encode(item.prompt),
                      SamplingParams(**{**params.__dict__, "seed": request_seed(seed, 10**6 + i, 0)}))
                 for i, item in enumerate(items)]
        with self._lock:
            self._eval_units.update((u.id, u) for u in units)
        self.workflow.launch(units)
        with self._lock:
            while not all(u.id in self._eval for u in units):
                self.check()
                self._lock.wait(timeout=0.5)
            outs = [self._eval.pop(u.id) for u in units]
            for u in units:
                self._eval_units.pop(u.id, None)
        # scored concurrently on the reward threads (a code reward's sandbox runs dominate an eval)
        futures = [self._pool.submit(self.workflow.finish, u, out) for u, out in zip(units, outs)]
        return [f.result() for f in futures]

    # ---- threads -------------------------------------------------------------------------
    def _guard(self, fn):
        def run():
            try:
                fn()
            except BufferClosed:
                pass
            except BaseException as exc:  # surfaced to the controller by check()
                self._error = exc
                self.buffer.wake()
        run.__name__ = fn.__name__
        return run

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
                    self._eval[rid] = out
                elif out.finish_reason != "abort":  # partials of an abort are not results
                    if rid in self._received or parse_request_id(rid)[0] not in self._pending:
                        self.counters["duplicate_outputs"] = self.counters.get("duplicate_outputs", 0) + 1
                        continue
                    self._received.add(rid)
                    self._dispatch(self._on_generated(out, to_abort))
            if self._polls % 50 == 0:
                self._received = {r for r in self._received if parse_request_id(r)[0] in self._pending}
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
        p = self._pending[pid]
        if out.finish_reason == "error":  # refused by the engine: scores 0, counted
            self.counters["request_errors"] += 1
        self.counters["samples_generated"] += 1
        self.counters["tokens_generated"] += len(out.token_ids)
        p.finished.append(k)
        self.lifecycle.move([rid], "scoring")
        ready = self._gate.finished(p.wave, out)
        if len(p.finished) == self.n and p.requests > self.n:
            # still generating (after a restore, requests that had ended before the checkpoint are gone)
            rest = [request_id(pid, j) for j in range(p.requests)
                    if j not in p.finished and self.lifecycle.state(request_id(pid, j)) == "generating"]
            self.lifecycle.abort(rest, "redundant", [{"prompt_id": pid, "request": parse_request_id(r)[1]}
                                                     for r in rest])
            to_abort.extend(rest)
            ready += self._gate.resolved(p.wave, len(rest))
        return ready

    def _dispatch(self, outs: list[GenerationOutput]) -> None:
        """Hand responses to the reward pool (under the lock)."""
        for out in outs:
            self._scoring += 1
            self._pool.submit(self._guard(lambda o=out: self._file_sample(o)))

    def _file_sample(self, out: GenerationOutput) -> None:
        try:
            self._finish_sample(out)
        finally:
            with self._lock:
                self._scoring -= 1
                self._lock.notify_all()

    def _finish_sample(self, out: GenerationOutput) -> None:
        pid, k = parse_request_id(out.request_id)
        with self._lock:
            pending = self._pending.get(pid)
            if pending is None or self.lifecycle.state(out.request_id) != "scoring":
                return  # its group was aborted (surplus) while the response waited
            unit = self._units(pid, [], [k])[0]
        start = time.monotonic()
        if self.inject_delay_s > 0:  # a slow reward, for tests and benchmarks
            time.sleep(self._rng.uniform(0, self.inject_delay_s))
        sample = self.workflow.finish(unit, out)
        with self._lock:
            self.counters["reward_seconds"] += time.monotonic() - start
            if self._pending.get(pid) is not pending or self.lifecycle.state(out.request_id) != "scoring":
                return
            pending.samples[k] = sample
            if len(pending.samples) < self.n:
                return
            group = self._make_group(pid, pending)
            to_buffer = self._group_done(pid, pending, group)
        if to_buffer:
            self._to_buffer(pid, group)
        else:
            self.buffer.wake()  # a filtered group left the pending versions
        with self._lock:
            later, self._later_aborts = self._later_aborts, []
        self._abort(later)

    def _make_group(self, pid: int, p: _Pending) -> Group:
        """The kept samples in request order, renumbered 0..n-1 (``meta['request']`` keeps k)."""
        samples = [p.samples[k] for k in sorted(p.samples)]
        for i, s in enumerate(samples):
            s.sample_index = i
        return Group(prompt_id=pid, admitted_version=p.version, data_index=p.data_index, samples=samples)

    def _group_done(self, pid: int, p: _Pending, group: Group) -> bool:
        """Filter, park (a spare) or send to the buffer (under the lock); True: put it in the buffer."""
        rids = [s.meta["request_id"] for s in group.samples]
        rule = None
        if self.filters.enabled:
            rule = filter_reason(group.rewards, [len(s.response_ids) for s in group.samples], self.filters)
        if rule is not None:
            self.lifecycle.filter_group(rids, rule, {"prompt_id": pid, "data_index": p.data_index,
                                                     "version": group.version, "rewards": group.rewards})
            self._prov.filtered(pid)
            del self._pending[pid]
            self._lock.notify_all()  # a slot (or a spare's place) is free
            return False
        if self._prov.is_spare(pid):
            p.parked = group
            self._prov.spare_finished(pid)
            self._lock.notify_all()
            return False
        self.lifecycle.move(rids, "buffered")
        return True

    def _to_buffer(self, pid: int, group: Group) -> None:
        self.buffer.put(group)  # in the buffer before it leaves pending: never in neither
        with self._lock:
            del self._pending[pid]
        self.buffer.wake()

    def score(self, item, token_ids: list[int]) -> float:
        """Reward of one response; a reward function that raises or returns no reward (NaN, inf,
        anything ``buffers.reward`` refuses) scores 0 and is counted, as in the reward pool (a NaN
        reward makes its group's advantages, and so the whole step's loss, NaN: the step would be
        skipped with every group in it)."""
        try:
            return reward_value(self.source.reward(item, self.source.decode(token_ids)))
        except FlashError:  # e.g. reward workers that keep dying (RewardFailed): stops the run
            raise
        except Exception:  # noqa: BLE001 - a user's reward bug (or a BadReward) must not kill the run
            with self._lock:
                self.counters["reward_errors"] += 1
            return 0.0


class RolloutScheduler(RolloutCore):
    """The core running the single-turn workflow (``controllers.workflows.single_turn``)."""

    def __init__(self, engine, source: PromptSource, buffer: SampleBuffer, staleness: StalenessManager,
                 params: SamplingParams, n: int, seed: int, *args, **kwargs):
        super().__init__(engine, SingleTurn(), source, buffer, staleness, params, n, seed, *args, **kwargs)
