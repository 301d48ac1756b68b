"""Episode workflow: a unit is one environment episode, played on the ``EnvWorker`` actors.

Parts, all in the driver:
- ``launch``: each unit resets its environment (on the worker of its slot) with the item's seed;
- the core's collector routes finished LLM turns here (``route``): the action is decoded and the
  environment stepped on the env pool; the step's observation joins the context and the next turn
  is asked (context = every token so far), until the game says done (or ``max_turns``: outcome
  ``truncated``). The finished episode is handed to the core (``RolloutCore.deliver``) by the
  thread that ended it, and ``finish`` gives its sample (reward = the episode's total reward);
- ``cancel`` (redundant, surplus): the episode stops at its next turn or step, its pending turn is
  aborted in the engine and its environment released.

Weight updates (docs/design.md invariant 4 for episodes): LLM turns follow ``rollout.interrupt`` inside
the engine; environment calls run on through the update. A step needs no policy, so holding steps
back would make every update wait for the slowest one in flight -- with a long-tailed environment
(a remote tool, a simulator) that wait is the tail the asynchronous rollout exists to hide. A step
that returns during the update asks its next turn, which the paused engine holds until ``resume``
(and which then carries the new version). Calls are atomic: a step is never cut.

Faults: an EnvWorker that dies (or hangs) is restarted by Ray and each episode that was on it is
played again from its reset with the same seeds (``flash.controllers.workflows.env_faults``); an episode
whose step hangs again after its replay ends there (outcome ``env_hung``), since the same seeds
lead it into the same step. After an
engine restart every turn an episode waits for is asked again (``requeue``), the environments
untouched. Turn ``t`` samples with seed ``unit seed + 7919 t``: the same turn asked again gives the
same tokens. Every finished episode is counted by outcome (``outcome/<name>``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ray

from flash.buffers import Sample
from flash.buffers.facts import FACTS, clean_facts
from flash.buffers.reward import BadReward, reward_value
from flash.buffers.trace import TokenTrace
from .base import Unit, turn_seed
from .env_faults import EnvWorkerFaults, _EpisodeHung, _EpisodeLost
from flash.engine.base import GenerationOutput, GenerationRequest, SamplingParams
from flash.envs.episode import Transcript, add_observation, add_turn, to_sample
from flash.usage import SpanRecorder

COUNTERS = ("episodes", "turns", "turns_aborted", "episodes_halted", "episodes_cancelled")
# How a finished episode reaches the core: a finished output. Its outcome is the environment's own
# name (in the sample) and may be anything, "abort" and "error" included, which the core reads as
# an engine's partial (dropped) and an engine's refusal.
ENDED = "stop"


@dataclass
class EpisodeCodec:
    """Text <-> tokens for episodes: prompts get ``<bos>``, observations do not."""

    encode_prompt: Callable[[str], list[int]]
    encode_observation: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]


@dataclass
class _Episode:
    unit: Unit
    worker: Any
    slot: int  # index of ``worker`` in the workflow's workers
    transcript: Transcript | None = None
    turns: int = 0
    cancelled: bool = False
    hangs: int = 0  # environment calls of this episode that hung (flash.controllers.workflows.env_faults)

    @property
    def key(self) -> str:
        return self.unit.id

    @property
    def training(self) -> bool:
        return self.unit.prompt_id >= 0


class Episodes(EnvWorkerFaults):
    """The episode workflow (``Workflow`` and ``Service``); ``core`` is set by the ``RolloutCore``."""

    def __init__(
        self,
        workers: list,
        codec: EpisodeCodec,
        max_turns: int,
        env_threads: int = 16,
        *,
        hang_timeout_s: float = 120.0,
        max_worker_restarts: int = 0,
    ):
        if not workers:
            raise ValueError("the episode workflow needs at least one EnvWorker")
        self.workers, self.codec, self.max_turns = workers, codec, max_turns
        self._core = None
        self._lock = threading.Condition()
        self._turns: dict[str, _Episode] = {}  # request id -> episode waiting on that LLM turn
        self._live: dict[str, _Episode] = {}  # unit id -> episode being played
        self._done: dict[str, Sample] = {}  # unit id -> finished episode, until ``finish`` takes it
        self._dropped: set[str] = set()  # turn ids of cancelled episodes (their late outputs)
        self._pool = ThreadPoolExecutor(max_workers=max(1, env_threads), thread_name_prefix="env")
        self.counters: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        self._keys = set(COUNTERS)  # the counters this workflow writes (its metrics)
        self.last_env_error = ""
        self.hang_timeout_s, self.max_worker_restarts = hang_timeout_s, max_worker_restarts
        self.events: list[dict] = []
        self.on_event: Callable[[dict], None] | None = None  # each worker death (events.jsonl)
        self._pids: list[int] | None = None  # each worker's process as last seen
        # wall spans in which an environment step was in flight (a simulated run counts them as
        # simulated time: flash.sim.accounting)
        self.env_spans = SpanRecorder()

    @property
    def core(self):
        return self._core

    @core.setter
    def core(self, core) -> None:
        """Share the core's counters, so that a checkpoint and the run's summary hold these too."""
        self._core = core
        core.counters.update(self.counters)
        self.counters = core.counters

    def _count(self, key: str, by: float = 1) -> None:
        """Add to counter ``key`` (under ``_lock``)."""
        self.counters[key] = self.counters.get(key, 0) + by
        self._keys.add(key)

    # ---- Workflow ------------------------------------------------------------------------
    def launch(self, units: list[Unit]) -> None:
        for unit in units:
            k = unit.index if unit.prompt_id < 0 else unit.prompt_id * self.core.n + unit.index
            slot = k % len(self.workers)
            ep = _Episode(unit, self.workers[slot], slot)
            with self._lock:
                self._live[unit.id] = ep
            self._launch(lambda ep=ep: self._reset(ep))  # type: ignore[misc]  # mypy cannot type a defaulted lambda

    def cancel(self, ids: list[str]) -> None:
        """Stop these episodes: a pending turn is aborted and its environment released now; one in
        an environment call stops (and is released) when the call returns."""
        turns, idle = [], []
        with self._lock:
            for uid in ids:
                ep = self._live.pop(uid, None)
                self._done.pop(uid, None)
                if ep is None:
                    continue
                ep.cancelled = True
                self._count("episodes_cancelled")
                rid = f"{uid}/{ep.turns}"
                if self._turns.pop(rid, None) is not None:
                    turns.append(rid)
                    idle.append(ep)
            self._dropped.update(turns)
        if turns:
            self.core.supervisor.call("abort", turns)
        for ep in idle:
            ep.worker.close.remote(ep.key)

    def route(self, outputs: list[GenerationOutput]) -> list[GenerationOutput]:
        """Each finished turn continues its episode; finished episodes reach the core by ``deliver``."""
        for out in outputs:
            self._on_turn(out)
        return []

    def finish(self, unit: Unit, output: GenerationOutput) -> Sample:
        with self._lock:
            return self._done.pop(unit.id)

    def requeue(self, lost: list[Unit], ids: list[str] | None) -> int:
        """After an engine restart: ask again every turn an episode still waits for -- of those
        ``ids`` only, when given (a restarted replica's) -- with the same context and seed. The
        environments are untouched (the episodes only waited on the LLM)."""
        only = None if ids is None else set(ids)
        with self._lock:
            reqs = [self._turn_request(ep) for rid, ep in self._turns.items() if only is None or rid in only]
        if reqs:
            self.core.supervisor.submit(reqs)
        return len(reqs)

    # ---- Service -------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Episode counters as ``rollout/episodes/<name>``, and ``faults/env``."""
        with self._lock:
            m = {f"rollout/episodes/{k}": float(self.counters.get(k, 0)) for k in sorted(self._keys)}
        m["faults/env"] = float(self.faults)
        return m

    def stop(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    # ---- one episode -----------------------------------------------------------------------
    def _launch(self, call: Callable[[], None]) -> None:
        """Run an environment call on the pool (one thread per call the workers can run)."""
        self._pool.submit(self.core._guard(call))

    def _reset(self, ep: _Episode) -> None:
        """Start (or, after its worker died, start again) the episode: same environment seed, and
        the same turn seeds, so it replays what it would have."""
        while True:
            ep.transcript, ep.turns = None, 0
            try:
                obs = self._env(ep, "reset", ep.key, ep.unit.item.meta["seed"])
                break
            except _EpisodeLost:
                continue
        ep.transcript = Transcript(TokenTrace(self.codec.encode_prompt(obs)), observations=[obs])
        self._submit_turn(ep)

    @staticmethod
    def _turn_request(ep: _Episode) -> GenerationRequest:
        """The episode's next LLM turn: its context so far, a seed of (unit, turn)."""
        seed = turn_seed(ep.unit.params.seed, ep.turns)
        assert ep.transcript is not None  # set by the reset, before the first turn
        params = SamplingParams(**{**ep.unit.params.__dict__, "seed": seed})
        return GenerationRequest(f"{ep.key}/{ep.turns}", ep.transcript.trace.tokens, params)

    def _submit_turn(self, ep: _Episode) -> None:
        req = self._turn_request(ep)
        with self._lock:
            if self._halted(ep):
                return
            self._turns[req.request_id] = ep
        self.core.supervisor.submit([req])

    def _halted(self, ep: _Episode) -> bool:
        """Cancelled, or a training episode after ``stop_admission``: it goes no further and its
        environment is released (called under the lock)."""
        if ep.cancelled or (ep.training and self.core.admission.stopped.is_set()):
            if not ep.cancelled:
                self._count("episodes_halted")
            ep.worker.close.remote(ep.key)
            return True
        return False

    def _on_turn(self, out: GenerationOutput) -> None:
        with self._lock:
            ep = self._turns.pop(out.request_id, None)
            if ep is None:  # a cancelled episode's turn, or one answered twice around a restart
                if out.request_id in self._dropped:
                    self._dropped.discard(out.request_id)
                else:
                    self._count("duplicate_outputs")
                return
            assert ep.transcript is not None  # an episode waiting on a turn was reset
            if out.finish_reason == "abort":  # an engine that reports aborted turns: play the turn again
                self._count("turns_aborted")
            elif out.finish_reason == "error":
                self._count("request_errors")
            else:
                add_turn(
                    ep.transcript,
                    list(out.token_ids),
                    list(out.logprobs),
                    list(out.versions),
                    self.core.admission.version,
                )
                ep.turns += 1
                self._count("turns")
                self._count("tokens_generated", len(out.token_ids))
        if out.finish_reason == "abort":
            self._submit_turn(ep)  # same context, same seed: the turn the engine would have given
        elif out.finish_reason == "error":  # refused by the engine (e.g. context full): ends, scored so far
            self._launch(lambda: self._finish(ep, "request_error"))
        else:
            action = self.codec.decode(list(out.token_ids))
            ep.transcript.actions.append(action)
            self._launch(lambda: self._step(ep, action))

    def _step(self, ep: _Episode, action: str) -> None:
        start = time.time()
        try:
            obs, reward, done, info = self._env(ep, "step", ep.key, action)
            self.env_spans.add(start, time.time())
        except _EpisodeHung:  # hung again after a replay: it ends here, scored so far
            self._finish(ep, "env_hung")
            return
        except _EpisodeLost:  # its worker died: the episode plays again from the start
            self._reset(ep)
            return
        except ray.exceptions.RayTaskError as exc:  # the game raised: this episode ends, the run goes on
            self._env_error(ep, str(exc).splitlines()[0])
            return
        try:  # a NaN reward would make its group's advantages, and the step, NaN
            reward = reward_value(reward)
        except BadReward as exc:
            self._env_error(ep, f"step returned reward {reward!r}: {exc}")
            return
        t = ep.transcript
        assert t is not None  # the episode was reset before its first step
        t.reward += reward
        t.observations.append(obs)
        if done or ep.turns >= self.max_turns:
            self._finish(ep, info.get("outcome", "done") if done else "truncated", info)
            return
        add_observation(t, self.codec.encode_observation(obs))
        self._submit_turn(ep)

    def _env_error(self, ep: _Episode, message: str) -> None:
        """The game failed this episode: it ends (``env_error``, counted, the message kept), the run goes on."""
        with self._lock:
            self._count("env_errors")
            self.last_env_error = message
        self._finish(ep, "env_error")

    def _finish(self, ep: _Episode, outcome: str, info: Any = None) -> None:
        """The episode ended: its sample waits for ``finish`` and the core hears of it. The numbers
        of the last step's ``info`` (but ``outcome``) are the episode's facts (flash.buffers.facts)."""
        ep.worker.close.remote(ep.key)
        u = ep.unit
        assert ep.transcript is not None  # an episode ends after its reset
        facts, dropped = clean_facts(
            {k: v for k, v in info.items() if k != "outcome"} if isinstance(info, dict) else {}
        )
        with self._lock:
            if ep.cancelled:
                return
            self._live.pop(ep.key, None)
            self._count("episodes")
            self._count(f"outcome/{outcome}")
            for reason, n in dropped.items():
                self._count(f"facts_dropped_{reason}", n)
            self._done[ep.key] = to_sample(
                ep.transcript,
                prompt_id=u.prompt_id,
                sample_index=u.index,
                admitted_version=u.version,
                outcome=outcome,
                meta={
                    **u.meta,
                    "data_index": u.data_index,
                    "seed": u.item.meta["seed"],
                    "request_id": u.id,
                    "request": u.index,
                    FACTS: facts,
                },
            )
        self.core.deliver([GenerationOutput(ep.key, list(ep.transcript.trace.prompt_ids), [], [], [], ENDED)])
