"""Agent workflow: a unit is one run of the user's agent against its own gateway session.

Parts, all in the driver:
- ``launch``: each unit opens a session on the gateway (flash.envs.gateway) and starts the agent
  on the agent runner (flash.envs.agents) with a real ``openai.AsyncOpenAI`` client on it;
- every chat call the agent makes reaches ``generate`` (on a gateway thread): it becomes an engine
  request of the unit -- id ``<unit>/<turn>``, the unit's sampling parameters (the run's
  temperature, at most ``rollout.max_new_tokens``, seed: ``turn_seed``) -- submitted
  through the core's engine client; ``route`` hands the engine's output back to the waiting call;
- when the agent returns, the session's tokens become the unit's ``Sample`` (token-exact: what was
  sampled is what is trained; flash.envs.chat_session), the numbers of its returned dict its facts
  (flash.buffers.facts; the rest counted as ``agent/facts_dropped_<reason>`` since the start), and the
  core hears of it (``deliver``);
- ``cancel`` (redundant, surplus): the agent is cancelled at its next await, its pending turn
  aborted in the engine, its session closed.

A weight update needs nothing held here: LLM turns follow ``rollout.interrupt`` inside the engine,
and an agent's own code (tools, environments) is its business. After an engine restart the turns
agents wait on are asked again (``requeue``) with the same ids and seeds.
"""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from flash.buffers import Sample
from flash.buffers.facts import DROP_REASONS, FACTS, clean_facts
from .base import Core, Unit, turn_seed
from flash.engine.base import GenerationOutput, GenerationRequest, SamplingParams


@dataclass
class _Run:
    unit: Unit
    turns: int = 0
    future: Any = None  # the agent runner's future (cancel stops the agent)
    waiting: dict[str, tuple[GenerationRequest, Future]] = field(default_factory=dict)
    cancelled: bool = False
    record: Any = None  # the last attempt's closed session


class Agents:
    """The agent workflow (``Workflow`` and ``Service``); ``core`` is set by the ``RolloutCore``."""

    def __init__(self, gateway, runner, to_sample, max_turns: int = 32, call_timeout_s: float = 300.0):
        self.gateway, self.runner, self.to_sample, self.max_turns = gateway, runner, to_sample, max_turns
        self.call_timeout_s = call_timeout_s  # a gateway thread never waits longer on one call
        self.core: Core | None = None
        self._lock = threading.Lock()
        self._runs: dict[str, _Run] = {}  # unit id -> run
        self._by_key: dict[str, _Run] = {}  # session key -> run
        self._turns: dict[str, _Run] = {}  # engine request id -> run
        self._done: dict[str, Sample] = {}
        self.untrained_tokens = 0  # sampled tokens of earlier segments (agent_runtime's docstring)
        self.facts_dropped: Counter = Counter()  # entries of agents' dicts that are not facts, per reason
        gateway.generate = self.generate

    # ---- Workflow ------------------------------------------------------------------------
    def launch(self, units: list[Unit]) -> None:
        for unit in units:
            run = _Run(unit)
            with self._lock:
                self._runs[unit.id] = run
            run.future = self.runner.run(
                unit.item,
                lambda r=run: self._open(r),
                lambda key, outcome, r=run: self._close(r, key, outcome),
                lambda result, r=run: self._finish(r, result),
            )

    def cancel(self, ids: list[str]) -> None:
        """Stop these runs: pending turns aborted in the engine (the waiting calls fail), the agents
        cancelled at their next await; their sessions close as the agents unwind."""
        runs, waiting = [], []
        with self._lock:
            for uid in ids:
                run = self._runs.pop(uid, None)
                self._done.pop(uid, None)
                if run is None:
                    continue
                run.cancelled = True
                runs.append(run)
                waiting += list(run.waiting.items())
                for rid in run.waiting:
                    self._turns.pop(rid, None)
                run.waiting = {}
        if waiting:
            assert self.core is not None  # bound by the RolloutCore before any call
            self.core.supervisor.call("abort", [rid for rid, _ in waiting])
        for _, (_, waiter) in waiting:
            waiter.set_exception(RuntimeError("the episode was cancelled"))
        for run in runs:
            if run.future is not None:  # launched a moment ago: its runner future is not set yet
                run.future.cancel()

    def route(self, outputs: list[GenerationOutput]) -> list[GenerationOutput]:
        """A finished turn answers the agent's waiting call; units finish through ``deliver``."""
        for out in outputs:
            with self._lock:
                run = self._turns.pop(out.request_id, None)
                pending = run.waiting.pop(out.request_id, None) if run is not None else None
            if pending is not None:
                pending[1].set_result(out)
        return []

    def finish(self, unit: Unit, output: GenerationOutput) -> Sample:
        with self._lock:
            return self._done.pop(unit.id)

    def requeue(self, lost: list[Unit], ids: list[str] | None) -> int:
        only = None if ids is None else set(ids)
        with self._lock:
            reqs = [
                req
                for run in self._runs.values()
                for rid, (req, _) in run.waiting.items()
                if only is None or rid in only
            ]
        if reqs:
            assert self.core is not None
            self.core.supervisor.submit(reqs)
        return len(reqs)

    # ---- Service -------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        dropped = {f"agent/facts_dropped_{k}": float(self.facts_dropped[k]) for k in DROP_REASONS}
        return {
            **self.runner.metrics(),
            "agent/untrained_tokens": float(self.untrained_tokens),
            **dropped,
            **{f"gateway/{k}": float(v) for k, v in self.gateway.metrics().items()},
        }

    def stop(self) -> None:
        """End every run: waiting calls fail (their HTTP handlers return), agents are cancelled,
        then the runner's loop and the gateway stop."""
        with self._lock:
            runs = list(self._runs.values())
            self._runs.clear()
            self._turns.clear()
            waiting = [w for run in runs for w in run.waiting.values()]
            for run in runs:
                run.cancelled, run.waiting = True, {}
        for _, waiter in waiting:
            waiter.set_exception(RuntimeError("the run is stopping"))
        for run in runs:
            if run.future is not None:
                run.future.cancel()
        self.runner.close()
        self.gateway.close()

    # ---- one run -------------------------------------------------------------------------
    def _open(self, run: _Run) -> str:
        key = self.gateway.open_session({"unit": run.unit.id})
        with self._lock:
            self._by_key[key] = run
        return key

    def _close(self, run: _Run, key: str, outcome: str) -> None:
        record = self.gateway.close_session(key)
        with self._lock:
            self._by_key.pop(key, None)
            run.record = record

    def generate(self, prompt_ids: list[int], params: SamplingParams, key: str) -> GenerationOutput:
        """One chat call of a session's agent, as an engine request of its unit (blocking)."""
        with self._lock:
            run = self._by_key.get(key)
            if run is None or run.cancelled:
                raise RuntimeError("the episode of this session has ended")
            turn, run.turns = run.turns, run.turns + 1
            if turn >= self.max_turns:
                raise RuntimeError(f"the agent made more than {self.max_turns} calls in one episode")
            base = run.unit.params
            req = GenerationRequest(
                f"{run.unit.id}/{turn}",
                list(prompt_ids),
                SamplingParams(
                    max_new_tokens=min(params.max_new_tokens, base.max_new_tokens),
                    temperature=base.temperature,
                    top_p=base.top_p,
                    stop_token_ids=list(base.stop_token_ids),
                    seed=turn_seed(base.seed, turn),
                ),
            )
            waiter: Future = Future()
            run.waiting[req.request_id] = (req, waiter)
            self._turns[req.request_id] = run
        assert self.core is not None
        self.core.supervisor.submit([req])
        return waiter.result(timeout=self.call_timeout_s)

    def _finish(self, run: _Run, result) -> None:
        u = run.unit
        with self._lock:
            if run.cancelled or self._runs.pop(u.id, None) is None:
                return
            record = getattr(run, "record", None)
            facts, dropped = clean_facts(result.info)
            self.facts_dropped.update(dropped)
            sample = self.to_sample(
                record,
                prompt_id=u.prompt_id,
                sample_index=u.index,
                admitted_version=u.version,
                reward=result.reward,
                outcome=result.outcome,
                meta={
                    **result.info,
                    **u.meta,
                    "data_index": u.data_index,
                    "attempts": result.attempts,
                    "request_id": u.id,
                    "request": u.index,
                    FACTS: facts,
                },
            )
            self.untrained_tokens += sample.meta.get("untrained_tokens", 0)
            self._done[u.id] = sample
        assert self.core is not None
        self.core.deliver([GenerationOutput(u.id, [], [], [], [], result.outcome)])
