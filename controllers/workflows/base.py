"""What a workflow is: how one admitted unit becomes a scored sample.

The scheduler core (``flash.controllers.scheduler.RolloutCore``) owns everything that is the same for
every kind of rollout -- admission under the staleness bound, spares, redundancy (start ``n + k``
units of a prompt, keep the first ``n`` to finish, cancel the rest), filters, the lifecycle and
its ledger, checkpoint state, evaluation -- and hands the rest to a ``Workflow``:

- ``launch(units)``: start these units (single-turn: one engine request each; episode: an
  environment reset, then LLM turns and environment steps until the game ends);
- ``cancel(ids)``: stop units the core no longer wants (redundant, surplus, cut): abort their
  engine requests and release their environments;
- ``route(outputs)``: engine outputs from the core's collector; returns the outputs of units that
  *finished* (single-turn: each response; episode: none -- a turn continues its episode, and a
  finished episode is handed to ``RolloutCore.deliver`` from the thread that ended it);
- ``finish(unit, output)``: the finished unit as a scored ``Sample`` (runs on the reward threads);
- ``requeue(lost, ids)``: after an engine restart, ask again what the engine lost.

``Service`` is the part the core reads for metrics and stops at the end of a run; nothing of a
workflow is held across a weight update (LLM turns follow ``rollout.interrupt`` in the engine,
environment calls and agents run on). Unit ids are ``"<prompt id>:<k>"`` for
training and ``"eval/<tag>/<i>"`` for evaluation; seeds depend only on (run seed, prompt id, k).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from flash.buffers import Sample
from flash.engine.base import GenerationOutput, SamplingParams
from flash.engine.client import EngineClient
from flash.usage import SpanRecorder


def request_seed(run_seed: int, prompt_id: int, sample_index: int) -> int:
    return (run_seed * 1_000_003 + prompt_id * 1_009 + sample_index * 7 + 1) % (2**31 - 1)


def turn_seed(unit_seed: int | None, turn: int) -> int:
    """The seed of a multi-turn unit's ``turn``-th LLM call (episodes, agent runs): the same turn
    asked again (after an engine restart) samples the same tokens."""
    return ((unit_seed or 0) + 7919 * turn) % (2**31 - 1)


def request_id(prompt_id: int, k: int) -> str:
    return f"{prompt_id}:{k}"


def parse_request_id(rid: str) -> tuple[int, int]:
    prompt_id, k = rid.split(":")
    return int(prompt_id), int(k)


@dataclass(frozen=True)
class Unit:
    """One admitted unit of work: request ``index`` of prompt ``prompt_id`` (-1: evaluation)."""

    id: str
    prompt_id: int
    index: int
    item: Any  # the task's TaskItem
    prompt_ids: list[int]  # the encoded prompt (empty where the workflow builds its own context)
    params: SamplingParams  # with the unit's seed
    version: int = 0  # the policy version it was admitted at
    data_index: int = -1
    meta: dict = field(default_factory=dict)  # copied into the sample's meta


@runtime_checkable
class Workflow(Protocol):
    def launch(self, units: list[Unit]) -> None: ...

    def cancel(self, ids: list[str]) -> None: ...

    def route(self, outputs: list[GenerationOutput]) -> list[GenerationOutput]: ...

    def finish(self, unit: Unit, output: GenerationOutput) -> Sample: ...

    def requeue(self, lost: list[Unit], ids: list[str] | None) -> int: ...


class Core(Protocol):
    """What a workflow uses of the scheduler core that binds it (``RolloutCore``): the engine
    client it submits through, the reward, and the hand-off of outputs it finished itself."""

    supervisor: EngineClient

    def score(self, item: Any, token_ids: list[int], training: bool = True) -> float: ...

    def deliver(self, outs: list[GenerationOutput]) -> None: ...


@runtime_checkable
class SteppedEnvs(Protocol):
    """A workflow whose episodes step environments: the wall spans in which a step was in flight,
    which the controller's timeline shows (``env_busy``) and a simulated run counts as its time."""

    env_spans: SpanRecorder


@runtime_checkable
class Service(Protocol):
    def metrics(self) -> dict[str, float]: ...

    def stop(self) -> None: ...
