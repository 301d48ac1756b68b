"""Rollout scheduler: admits prompts under the staleness bound and turns responses into groups.

Three kinds of threads, all in the driver:
- *admission*: whenever ``StalenessManager.can_admit`` allows, takes the next prompt from the
  task's stream and submits its ``n`` samples to the engine as ``n`` independent requests;
- *collector*: pulls finished responses from the engine as they finish;
- *reward pool*: scores each response as soon as it arrives (queue scheduling), concurrently with
  generation; when a group's ``n`` samples are scored the group goes into the SampleBuffer.

Every admitted prompt is in exactly one place at any time: in flight here, in the buffer, or
trained (the controller's ledger) -- the bookkeeping that DESIGN.md invariant 5 rests on.
Request seeds depend only on (run seed, prompt id, sample index), never on timing.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import ray

from buffers import BufferClosed, Group, Sample, SampleBuffer
from controllers.staleness import StalenessManager
from flash.engine.base import GenerationOutput, GenerationRequest, SamplingParams


def request_seed(run_seed: int, prompt_id: int, sample_index: int) -> int:
    return (run_seed * 1_000_003 + prompt_id * 1_009 + sample_index * 7 + 1) % (2**31 - 1)


@dataclass
class PromptSource:
    """The task's prompt stream as the scheduler needs it: item, token ids, reward."""

    item: Callable[[int], Any]  # data index -> TaskItem
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    reward: Callable[[Any, str], float]
    guard: Any = None  # flash.guards.InputGuard: skips (or rejects) malformed/empty/too long prompts

    def take(self, index: int) -> tuple[int, Any, list[int]]:
        """The first usable prompt at data position >= ``index``: (its index, item, token ids)."""
        if self.guard is not None:
            return self.guard.take(index, self.item, self.encode)
        item = self.item(index)
        return index, item, self.encode(item.prompt)


@dataclass
class _Pending:
    item: Any
    data_index: int
    version: int
    samples: dict[int, Sample] = field(default_factory=dict)


class RolloutScheduler:
    def __init__(self, engine, source: PromptSource, buffer: SampleBuffer,
                 staleness: StalenessManager, params: SamplingParams, n: int, seed: int,
                 reward_workers: int = 4, inject_delay_s: float = 0.0, start_index: int = 0):
        self.engine, self.source, self.buffer = engine, source, buffer
        self.staleness, self.params, self.n, self.seed = staleness, params, n, seed
        self.inject_delay_s = inject_delay_s
        self._rng = random.Random(seed + 17)
        self._lock = threading.Condition()
        self._pending: dict[int, _Pending] = {}
        self._admitted = 0
        self._next_index = start_index
        self._version = 0
        self._stop = threading.Event()
        self._admit_stop = threading.Event()
        self._scoring = 0  # responses handed to the reward pool and not yet filed
        self._polls = 0  # collector iterations, for quiesce()
        self._error: BaseException | None = None
        self._eval: dict[str, GenerationOutput] = {}
        self._pool = ThreadPoolExecutor(max_workers=max(1, reward_workers), thread_name_prefix="reward")
        self.counters = {"samples_generated": 0, "tokens_generated": 0, "reward_errors": 0,
                         "request_errors": 0}
        self.supervisor = None  # flash.faults.EngineSupervisor, when engine faults are handled
        self._received: set[str] = set()  # request ids taken from the engine for pending prompts
        self._eval_reqs: dict[str, GenerationRequest] = {}  # evaluation requests not yet answered
        self._threads = [threading.Thread(target=self._guard(f), daemon=True, name=f.__name__)
                         for f in (self._admit_loop, self._collect_loop)]

    # ---- controller-facing API -------------------------------------------------------------
    def start(self) -> None:
        """Start collecting (evaluation works from here on); admission starts separately."""
        self._threads[1].start()

    def start_admission(self) -> None:
        self._threads[0].start()

    def set_version(self, version: int) -> None:
        """The policy moved to ``version``: more prompts may be admitted."""
        with self._lock:
            self._version = version
            self._lock.notify_all()

    def pending_versions(self) -> list[int]:
        """Admission versions of groups not yet complete (one entry per group)."""
        with self._lock:
            return [p.version for p in self._pending.values()]

    def pending_ids(self) -> list[int]:
        with self._lock:
            return sorted(self._pending)

    @property
    def admitted(self) -> int:
        with self._lock:
            return self._admitted

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
        self._pool.shutdown(wait=True, cancel_futures=True)

    def evaluate(self, items: list, params: SamplingParams, tag: str, seed: int) -> list[float]:
        """Generate one response per item through the same engine; rewards in item order."""
        ids = [f"eval/{tag}/{i}" for i in range(len(items))]
        reqs = []
        for i, (rid, item) in enumerate(zip(ids, items)):
            p = SamplingParams(**{**params.__dict__, "seed": request_seed(seed, 10**6 + i, 0)})
            reqs.append(GenerationRequest(rid, self.source.encode(item.prompt), p))
        with self._lock:
            self._eval_reqs.update((r.request_id, r) for r in reqs)
        self._submit(reqs)
        with self._lock:
            while not all(r in self._eval for r in ids):
                self.check()
                self._lock.wait(timeout=0.5)
            outs = [self._eval.pop(r) for r in ids]
            for r in ids:
                self._eval_reqs.pop(r, None)
        return [self._score(item, out.token_ids) for item, out in zip(items, outs)]

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

    def _admit_loop(self) -> None:
        while not self._admit_stop.is_set():
            with self._lock:
                self._lock.wait_for(lambda: self._admit_stop.is_set() or
                                    self.staleness.can_admit(self._admitted, self._version))
                if self._admit_stop.is_set():
                    return
                batch = []
                while self.staleness.can_admit(self._admitted, self._version):
                    batch.extend(self._admit_one())
            self._submit(batch)

    def _admit_one(self) -> list[GenerationRequest]:
        prompt_id = self._admitted
        index, item, ids = self.source.take(self._next_index)
        self._pending[prompt_id] = _Pending(item=item, data_index=index, version=self._version)
        self._admitted += 1
        self._next_index = index + 1
        return [GenerationRequest(f"{prompt_id}:{k}", ids,
                                  SamplingParams(**{**self.params.__dict__,
                                                    "seed": request_seed(self.seed, prompt_id, k)}))
                for k in range(self.n)]

    def _collect_loop(self) -> None:
        while not self._stop.is_set():
            outs = self._poll()
            with self._lock:
                for out in outs:
                    if out.request_id.startswith("eval/"):
                        self._eval[out.request_id] = out
                    elif out.finish_reason != "abort":
                        if out.finish_reason == "error":  # refused by the engine: scores 0, counted
                            self.counters["request_errors"] += 1
                        self.counters["samples_generated"] += 1
                        self.counters["tokens_generated"] += len(out.token_ids)
                        self._scoring += 1
                        self._pool.submit(self._guard(lambda o=out: self._file_sample(o)))
                self._polls += 1
                self._lock.notify_all()

    def _file_sample(self, out: GenerationOutput) -> None:
        try:
            self._finish_sample(out)
        finally:
            with self._lock:
                self._scoring -= 1
                self._lock.notify_all()

    def _finish_sample(self, out: GenerationOutput) -> None:
        prompt_id, k = (int(x) for x in out.request_id.split(":"))
        with self._lock:
            pending = self._pending[prompt_id]
        if self.inject_delay_s > 0:
            time.sleep(self._rng.uniform(0, self.inject_delay_s))
        sample = Sample(
            prompt_id=prompt_id, sample_index=k, prompt_ids=list(out.prompt_ids),
            response_ids=list(out.token_ids), behav_logprobs=list(out.logprobs),
            versions=list(out.versions), finish_reason=out.finish_reason,
            admitted_version=pending.version, meta={"data_index": pending.data_index},
        )
        sample.reward = self._score(pending.item, out.token_ids)
        with self._lock:
            pending.samples[k] = sample
            done = len(pending.samples) == self.n
        if done:
            group = Group(prompt_id=prompt_id, admitted_version=pending.version,
                          data_index=pending.data_index,
                          samples=[pending.samples[i] for i in range(self.n)])
            self.buffer.put(group)  # in the buffer before it leaves pending: never in neither
            with self._lock:
                del self._pending[prompt_id]
            self.buffer.wake()

    def _score(self, item, token_ids: list[int]) -> float:
        """Reward of one response; a reward function that raises scores 0 and is counted."""
        try:
            return float(self.source.reward(item, self.source.decode(token_ids)))
        except Exception:  # noqa: BLE001 - a user's reward bug must not kill the run
            with self._lock:
                self.counters["reward_errors"] += 1
            return 0.0

    # ---- checkpoint and fault hooks (flash.checkpoint, flash.faults) ---------------------------
    def state_dict(self) -> dict:
        """Data position, admissions, version, counters, RNG and the prompts in flight."""
        with self._lock:
            version, state, gauss = self._rng.getstate()
            return {
                "admitted": self._admitted, "next_index": self._next_index, "version": self._version,
                "counters": dict(self.counters), "rng": [version, list(state), gauss],
                "pending": [{"prompt_id": pid, "data_index": p.data_index, "version": p.version}
                            for pid, p in sorted(self._pending.items())],
            }

    def load_state_dict(self, state: dict) -> int:
        """Restore a checkpoint's state before ``start``; the prompts that were in flight restart
        from scratch (same prompt ids, same request seeds). Returns how many prompts restarted."""
        with self._lock:
            self._admitted, self._next_index = state["admitted"], state["next_index"]
            self._version = state["version"]
            self.counters.update(state["counters"])
            version, rng, gauss = state["rng"]
            self._rng.setstate((version, tuple(rng), gauss))
            reqs = []
            for p in state["pending"]:
                item = self.source.item(p["data_index"])
                self._pending[p["prompt_id"]] = _Pending(item=item, data_index=p["data_index"], version=p["version"])
                reqs += self._requests(p["prompt_id"], self.source.encode(item.prompt), range(self.n))
        self._submit(reqs)
        return len(state["pending"])

    def requeue_lost(self) -> int:
        """After an engine restart: resubmit every request of a pending prompt (and of an evaluation)
        whose output was not taken from the engine yet. Returns how many were resubmitted."""
        with self._lock:
            reqs = [r for r in self._eval_reqs.values() if r.request_id not in self._eval]
            for pid, p in sorted(self._pending.items()):
                lost = [k for k in range(self.n) if f"{pid}:{k}" not in self._received]
                if lost:
                    reqs += self._requests(pid, self.source.encode(p.item.prompt), lost)
        self._submit(reqs)
        return len(reqs)

    def _requests(self, prompt_id: int, ids: list[int], ks) -> list[GenerationRequest]:
        return [GenerationRequest(f"{prompt_id}:{k}", ids,
                                  SamplingParams(**{**self.params.__dict__,
                                                    "seed": request_seed(self.seed, prompt_id, k)}))
                for k in ks]

    def _submit(self, reqs: list[GenerationRequest]) -> None:
        """Submit to the engine; with a supervisor a dead engine is restarted and the requests of
        pending prompts are resubmitted by ``requeue_lost``, so a failed submit loses nothing."""
        if not reqs:
            return
        if self.supervisor is None:
            ray.get(self.engine.submit.remote(reqs))
        else:
            self.supervisor.submit(reqs)

    def _poll(self) -> list[GenerationOutput]:
        """Finished outputs; with a supervisor, engine faults are recovered here and an output for a
        request already taken (resubmitted around a fault) or for a prompt no longer pending is dropped."""
        if self.supervisor is None:
            return ray.get(self.engine.get_finished.remote(0.2))
        outs = self.supervisor.poll(0.2)
        keep = []
        with self._lock:
            for out in outs:
                rid = out.request_id
                if not rid.startswith("eval/") and out.finish_reason != "abort":
                    if rid in self._received or int(rid.split(":")[0]) not in self._pending:
                        self.counters["duplicate_outputs"] = self.counters.get("duplicate_outputs", 0) + 1
                        continue
                    self._received.add(rid)
                keep.append(out)
            if self._polls % 50 == 0:
                self._received = {r for r in self._received if int(r.split(":")[0]) in self._pending}
        return keep
