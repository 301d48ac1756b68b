"""Episode scheduler: admits environment seeds under the staleness bound and plays their episodes.

The multi-turn counterpart of ``RolloutScheduler``, with the interface the controller uses on it
(``start``/``start_admission``, ``set_version``, ``pending_versions``/``pending_ids``,
``admitted``, ``check``, ``stop_admission``, ``quiesce``, ``stop``, ``evaluate``, ``counters``)
plus ``suspend``/``resume``, which the controller calls around a weight update.

Parts, all in the driver:
- *admission* thread: whenever ``StalenessManager.can_admit`` allows, takes the next seed of the
  task's stream and starts its ``n`` episodes (one group) on the ``EnvWorker`` actors;
- *collector* thread: pulls finished LLM turns from the engine as they finish;
- *env pool*: threads that call the env workers (``reset``, ``step``) and, once a step returns,
  append its observation and submit the next LLM turn (context = every token so far), or, when
  the game says done (or ``max_turns`` is reached: outcome ``truncated``), file the episode.
  A group's ``n`` episodes done -> one ``Group`` into the SampleBuffer.

Suspend (DESIGN.md invariant 4 for episodes): LLM turns follow ``rollout.interrupt`` inside the
engine; environment calls are atomic. ``suspend`` waits for every call in flight to return and
holds back new ones until ``resume``, so no step is ever cut and none runs across a weight update.

Worker faults: an EnvWorker that dies (or hangs past ``hang_timeout_s``: then it is killed) is
restarted by Ray, without its environments. Each episode that was on it is played again from its
reset, same environment seed and same turn seeds, when it next touches the worker (a call in
flight fails; a later one finds no environment, ``EnvLost``); its partial transcript is dropped, so
the episode is filed once. Each death is counted once (``faults/env``: the worker's pid changed),
logged once, and reported to ``on_event``; past ``max_worker_restarts`` the run stops
(``controllers.env_faults``). Engine faults: with a supervisor (``flash.engine.client``) a restarted
engine's lost turns are asked again (``requeue_lost``), the environments untouched.

Every admitted seed is in exactly one place: in flight here, in the buffer, or trained. Every
finished episode is counted by outcome (``outcome/<name>``), every refused turn in
``request_errors``. Turn seeds depend only on (run seed, seed id, episode index, turn).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import ray

from buffers import BufferClosed, Group, Sample, SampleBuffer
from controllers.env_faults import EnvWorkerFaults, _EpisodeLost
from controllers.rollout_scheduler import request_seed
from controllers.staleness import StalenessManager
from flash.engine.base import GenerationOutput, GenerationRequest, SamplingParams
from flash.envs.episode import Transcript, add_observation, add_turn, to_sample


@dataclass
class EpisodeCodec:
    """Text <-> tokens for episodes: prompts get ``<bos>``, observations do not."""

    encode_prompt: Callable[[str], list[int]]
    encode_observation: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]


@dataclass
class _Episode:
    key: str  # "<seed id>:<k>" for training, "eval/<tag>/<i>" for evaluation
    seed: int  # the environment's reset seed
    worker: Any
    base_seed: int  # turn t samples with seed base_seed + t
    params: SamplingParams
    prompt_id: int = -1  # -1: an evaluation episode
    slot: int = 0  # index of ``worker`` in the scheduler's workers
    sample_index: int = 0
    transcript: Transcript | None = None
    turns: int = 0


@dataclass
class _Pending:
    data_index: int
    version: int
    seed: int
    samples: dict[int, Sample] = field(default_factory=dict)


class EpisodeScheduler(EnvWorkerFaults):
    def __init__(self, engine, workers: list, task, codec: EpisodeCodec, buffer: SampleBuffer,
                 staleness: StalenessManager, params: SamplingParams, n: int, seed: int,
                 max_turns: int, start_index: int = 0, env_threads: int = 16, *,
                 hang_timeout_s: float = 120.0, max_worker_restarts: int = 0):
        if not workers:
            raise ValueError("EpisodeScheduler needs at least one EnvWorker")
        self.engine, self.workers, self.task, self.codec = engine, workers, task, codec
        self.buffer, self.staleness, self.params = buffer, staleness, params
        self.n, self.seed, self.max_turns = n, seed, max_turns
        self._lock = threading.Condition()
        self._pending: dict[int, _Pending] = {}
        self._turns: dict[str, _Episode] = {}  # request id -> episode waiting on that LLM turn
        self._eval: dict[str, float] = {}
        self._admitted, self._next_index, self._version = 0, start_index, 0
        self._env_busy = 0  # environment calls in flight
        self._suspended = False
        self._deferred: list[Callable[[], None]] = []  # env calls held back while suspended
        self._polls = 0
        self._stop, self._admit_stop = threading.Event(), threading.Event()
        self._error: BaseException | None = None
        self._pool = ThreadPoolExecutor(max_workers=max(1, env_threads), thread_name_prefix="env")
        self.counters: dict[str, float] = {"episodes": 0, "turns": 0, "tokens_generated": 0, "request_errors": 0,
                                           "reward_errors": 0, "turns_aborted": 0, "episodes_halted": 0,
                                           "suspend_wait_s": 0.0}
        self.last_env_error = ""
        self.hang_timeout_s, self.max_worker_restarts = hang_timeout_s, max_worker_restarts
        self.faults = 0  # environment workers that died (faults/env)
        self.events: list[dict] = []
        self.on_event: Callable[[dict], None] | None = None  # each death (flash.app.runner: events.jsonl)
        self._pids: list[int] | None = None  # each worker's process as last seen
        self._threads = [threading.Thread(target=self._guard(f), daemon=True, name=f.__name__)
                         for f in (self._admit_loop, self._collect_loop)]
        self.supervisor = None  # flash.engine.client.EngineClient: engine faults recovered (requeue_lost)

    # ---- controller-facing API -------------------------------------------------------------
    def start(self) -> None:
        if self._pids is None:
            self.pids()
        self._threads[1].start()

    def start_admission(self) -> None:
        self._threads[0].start()

    def set_version(self, version: int) -> None:
        with self._lock:
            self._version = version
            self._lock.notify_all()

    def pending_versions(self) -> list[int]:
        with self._lock:
            return [p.version for p in self._pending.values()]

    def pending_ids(self) -> list[int]:
        with self._lock:
            return sorted(self._pending)

    @property
    def admitted(self) -> int:
        with self._lock:
            return self._admitted

    # ---- the lifecycle hooks the controller calls on every scheduler --------------------------
    def mark_trained(self, groups) -> None:
        """Nothing to move: an episode's outcome is counted when it finishes (``counters``)."""

    def drain_outcomes(self) -> list[dict]:
        """Episodes are never filtered or aborted by rule here: no ledger events beyond trained."""
        return []

    def metrics(self) -> dict[str, float]:
        """Episode counters (episodes, turns, outcomes, errors) as ``rollout/episodes/<name>``."""
        with self._lock:
            return {f"rollout/episodes/{k}": float(v) for k, v in self.counters.items()}

    def check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"episode scheduler failed: {self._error!r}") from self._error

    def suspend(self, timeout: float = 120.0) -> float:
        """Hold back new environment calls and wait for those in flight; returns seconds waited."""
        start = time.monotonic()
        with self._lock:
            self._suspended = True
            ok = self._lock.wait_for(lambda: self._error is not None or self._env_busy == 0, timeout)
            waited = time.monotonic() - start
            self.counters["suspend_wait_s"] += waited
        self.check()
        if not ok:
            raise TimeoutError(f"an environment step ran past {timeout}s during suspend; "
                               "a step must return (raise task.step_delay_s or fix the environment)")
        return waited

    def resume(self) -> None:
        with self._lock:
            self._suspended = False
            deferred, self._deferred = self._deferred, []
        for call in deferred:
            self._launch(call)

    def stop_admission(self) -> None:
        """No more seeds; training episodes stop at their next turn or step (they stay in flight)."""
        with self._lock:
            self._admit_stop.set()
            self._lock.notify_all()

    def quiesce(self, timeout: float = 60.0) -> None:
        """Wait until the collector polled twice more and no environment call is in flight."""
        with self._lock:
            polls = self._polls
            ok = self._lock.wait_for(lambda: self._error is not None or (
                self._polls >= polls + 2 and self._env_busy == 0), timeout)
        self.check()
        if not ok:
            raise TimeoutError("episode scheduler did not quiesce")

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
        """Play one episode per item (its seed) through the same engine; rewards in item order."""
        keys = [f"eval/{tag}/{i}" for i in range(len(items))]
        for i, (key, item) in enumerate(zip(keys, items)):
            slot = i % len(self.workers)
            ep = _Episode(key, item.meta["seed"], self.workers[slot], request_seed(seed, 10**6 + i, 0), params,
                          slot=slot)
            self._launch(lambda ep=ep: self._reset(ep))
        with self._lock:
            while not all(k in self._eval for k in keys):
                self.check()
                self._lock.wait(timeout=0.5)
            return [self._eval.pop(k) for k in keys]

    # ---- checkpoint hooks (flash.app.run_state) ------------------------------------------------
    def state_dict(self) -> dict:
        """Data position, admissions, version, counters and the seeds in flight.

        A seed in flight keeps its finished episodes (complete, scored samples); its unfinished ones
        restart on resume from the start: the same environment seed and turn seeds, fresh env
        workers. Its prompt is never lost, and no episode is kept twice.
        """
        with self._lock:
            pending = [{"prompt_id": pid, "data_index": p.data_index, "version": p.version, "seed": p.seed,
                        "samples": [asdict(smp) for _, smp in sorted(p.samples.items())]}
                       for pid, p in sorted(self._pending.items())]
            return {"admitted": self._admitted, "next_index": self._next_index, "version": self._version,
                    "counters": dict(self.counters), "pending": pending, "faults": self.faults}

    def load_state_dict(self, state: dict, buffered_groups: list[Group] | None = None) -> int:
        """Restore a checkpoint's state before ``start`` and restart the unfinished episodes of the
        seeds in flight; returns how many episodes restarted. (``buffered_groups``: the restored
        buffer's, unused here -- a buffered group is no longer pending.)"""
        episodes = []
        with self._lock:
            self._admitted, self._next_index = state["admitted"], state["next_index"]
            self._version = state["version"]
            self.counters.update(state["counters"])
            self.faults = state.get("faults", 0)  # faults/env continues its curve
            for p in state["pending"]:
                pid = p["prompt_id"]
                done = {d["sample_index"]: Sample(**d) for d in p["samples"]}
                self._pending[pid] = _Pending(data_index=p["data_index"], version=p["version"], seed=p["seed"],
                                              samples=done)
                episodes += [self._episode(pid, k, p["seed"]) for k in range(self.n) if k not in done]
        for ep in episodes:
            self._launch(lambda ep=ep: self._reset(ep))
        return len(episodes)

    # ---- threads -------------------------------------------------------------------------
    def _guard(self, fn):
        def run():
            try:
                fn()
            except BufferClosed:
                pass
            except BaseException as exc:  # noqa: BLE001 - surfaced to the controller by check()
                self._error = exc
                with self._lock:
                    self._lock.notify_all()
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
                episodes = []
                while self.staleness.can_admit(self._admitted, self._version):
                    episodes.extend(self._admit_one())
            for ep in episodes:
                self._launch(lambda ep=ep: self._reset(ep))

    def _admit_one(self) -> list[_Episode]:
        prompt_id, index = self._admitted, self._next_index
        seed = self.task.item(index, "train").meta["seed"]
        self._pending[prompt_id] = _Pending(data_index=index, version=self._version, seed=seed)
        self._admitted += 1
        self._next_index += 1
        return [self._episode(prompt_id, k, seed) for k in range(self.n)]

    def _episode(self, prompt_id: int, k: int, seed: int) -> _Episode:
        """Episode ``k`` of a seed: its worker slot, env seed and turn seeds depend on nothing else."""
        slot = (prompt_id * self.n + k) % len(self.workers)
        return _Episode(f"{prompt_id}:{k}", seed, self.workers[slot], request_seed(self.seed, prompt_id, k),
                        self.params, prompt_id=prompt_id, sample_index=k, slot=slot)

    def _collect_loop(self) -> None:
        while not self._stop.is_set():
            if self.supervisor is None:
                outs = ray.get(self.engine.get_finished.remote(0.2))
            else:  # engine faults recovered there; the turns it lost are asked again (requeue_lost)
                outs = self.supervisor.poll(0.2)
            for out in outs:
                self._on_turn(out)
            with self._lock:
                self._polls += 1
                self._lock.notify_all()

    # ---- one episode -----------------------------------------------------------------------
    def _launch(self, call: Callable[[], None]) -> None:
        """Run an environment call on the pool, or hold it back while suspended."""
        with self._lock:
            if self._suspended:
                self._deferred.append(call)
                return
            self._env_busy += 1
        self._pool.submit(self._guard(lambda: self._env_call(call)))

    def _env_call(self, call: Callable[[], None]) -> None:
        try:
            call()
        finally:
            with self._lock:
                self._env_busy -= 1
                self._lock.notify_all()

    def _reset(self, ep: _Episode) -> None:
        """Start (or, after its worker died, start again) the episode: same environment seed; turn
        ``t`` samples with seed ``base_seed + 7919 t`` again, so it replays what it would have."""
        while True:
            ep.transcript, ep.turns = None, 0
            try:
                obs = self._env(ep, "reset", ep.key, ep.seed)
                break
            except _EpisodeLost:
                continue
        ep.transcript = Transcript(prompt_ids=self.codec.encode_prompt(obs), observations=[obs])
        self._submit_turn(ep)

    @staticmethod
    def _turn_request(ep: _Episode) -> GenerationRequest:
        """The episode's next LLM turn: its context so far, a seed of (episode, turn), so the same
        turn asked again (an aborted turn, an engine restart) gives the same tokens."""
        params = SamplingParams(**{**ep.params.__dict__, "seed": (ep.base_seed + 7919 * ep.turns) % (2**31 - 1)})
        return GenerationRequest(f"{ep.key}/{ep.turns}", ep.transcript.context, params)

    def _submit_turn(self, ep: _Episode) -> None:
        req = self._turn_request(ep)
        with self._lock:
            if self._halted(ep):
                return
            self._turns[req.request_id] = ep
        self._submit([req])

    def _submit(self, reqs: list[GenerationRequest]) -> None:
        """To the engine; with a supervisor a dead engine is restarted and every turn still waiting
        is asked again by ``requeue_lost``, so a failed submit loses nothing."""
        if self.supervisor is None:
            ray.get(self.engine.submit.remote(reqs))
        else:
            self.supervisor.submit(reqs)

    def requeue_lost(self, ids: list[str] | None = None) -> int:
        """After an engine restart (``flash.engine.client``): ask again every turn an episode still waits
        for -- of those ``ids`` only, when given (a restarted replica's) -- with the same context and
        seed. Environment state is untouched: the episode only waited on the LLM. Returns how many."""
        with self._lock:
            reqs = [self._turn_request(ep) for rid, ep in self._turns.items() if ids is None or rid in set(ids)]
        if reqs:
            self._submit(reqs)
        return len(reqs)

    def _halted(self, ep: _Episode) -> bool:
        """After ``stop_admission`` a training episode goes no further (called under the lock)."""
        if ep.prompt_id >= 0 and self._admit_stop.is_set():
            self.counters["episodes_halted"] += 1
            ep.worker.close.remote(ep.key)
            return True
        return False

    def _on_turn(self, out: GenerationOutput) -> None:
        with self._lock:
            ep = self._turns.pop(out.request_id, None)
            if ep is None and self.supervisor is not None:  # a turn answered twice around a restart
                self.counters["duplicate_outputs"] = self.counters.get("duplicate_outputs", 0) + 1
                return
            if ep is None:
                raise RuntimeError(f"engine returned unknown request {out.request_id!r}")
            if out.finish_reason == "abort":  # an engine that reports aborted turns: play the turn again
                self.counters["turns_aborted"] += 1
        if out.finish_reason == "abort":
            self._submit_turn(ep)  # same context, same seed: the turn the engine would have given
            return
        with self._lock:
            if out.finish_reason == "error":
                self.counters["request_errors"] += 1
            else:
                add_turn(ep.transcript, list(out.token_ids), list(out.logprobs), list(out.versions), self._version)
                ep.turns += 1
                self.counters["turns"] += 1
                self.counters["tokens_generated"] += len(out.token_ids)
        if out.finish_reason == "error":  # refused by the engine (e.g. context full): ends, scored so far
            self._launch(lambda: self._finish(ep, "request_error"))
            return
        action = self.codec.decode(list(out.token_ids))
        ep.transcript.actions.append(action)
        self._launch(lambda: self._step(ep, action))

    def _step(self, ep: _Episode, action: str) -> None:
        try:
            obs, reward, done, info = self._env(ep, "step", ep.key, action)
        except _EpisodeLost:  # its worker died: the episode plays again from the start
            self._reset(ep)
            return
        except ray.exceptions.RayTaskError as exc:  # the game raised: this episode ends, the run goes on
            with self._lock:
                self.counters["env_errors"] = self.counters.get("env_errors", 0) + 1
                self.last_env_error = str(exc).splitlines()[0]
            self._finish(ep, "env_error")
            return
        t = ep.transcript
        t.reward += float(reward)
        t.observations.append(obs)
        if done or ep.turns >= self.max_turns:
            self._finish(ep, info.get("outcome", "done") if done else "truncated")
            return
        add_observation(t, self.codec.encode_observation(obs))
        self._submit_turn(ep)

    def _finish(self, ep: _Episode, outcome: str) -> None:
        ep.worker.close.remote(ep.key)
        with self._lock:
            self.counters["episodes"] += 1
            self.counters[f"outcome/{outcome}"] = self.counters.get(f"outcome/{outcome}", 0) + 1
            if ep.prompt_id < 0:
                self._eval[ep.key] = ep.transcript.reward
                self._lock.notify_all()
                return
            pending = self._pending[ep.prompt_id]
            sample = to_sample(ep.transcript, prompt_id=ep.prompt_id, sample_index=ep.sample_index,
                               admitted_version=pending.version, outcome=outcome,
                               meta={"data_index": pending.data_index, "seed": ep.seed})
            pending.samples[ep.sample_index] = sample
            done = len(pending.samples) == self.n
        if done:
            group = Group(prompt_id=ep.prompt_id, admitted_version=pending.version, data_index=pending.data_index,
                          samples=[pending.samples[i] for i in range(self.n)])
            self.buffer.put(group)  # in the buffer before it leaves pending: never in neither
            with self._lock:
                del self._pending[ep.prompt_id]
            self.buffer.wake()
