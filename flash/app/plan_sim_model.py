"""The planner's model of a simulated run (``rollout.engine: sim``, ``train.backend: sim``): how
seconds per step change with the simulated cluster's scale. Small pure functions and one event
loop; every time is in simulated seconds.

A simulated run's time follows a GPU cost model (``flash.sim.cost``), so the planner takes its
*shape* from the same cost model and fits only how far the run departs from it (prefill after
requeues, pacing, the controller's real work). Notation, for ``G_r`` rollout GPUs of ``tp`` per
engine instance, ``G_t`` train GPUs, ``B`` prompts per step of ``n`` samples each:

* engine instances ``I = G_r / tp``; one engine step (one token id, ``s`` simulated tokens) over
  ``R`` running sequences holding ``C`` context tokens costs one instance's decode at the
  per-instance load (the engine spreads its sequences evenly):

      e(R, C) = k_e · decode_run(b = ⌈R / I⌉, context = C / min(R, I), iterations = s)

  plus ``k_e · prefill(tokens / min(new, I))`` for the sequences it admits. Every running sequence
  advances one id per step, so a synchronous round runs ``max L`` steps (the long tail) while its
  per-step cost shrinks as sequences finish; the per-instance load ``B·n / I`` is what scaling the
  GPUs and the batch together keeps fixed.
* trainer: ``U = k_t · train_step(tokens, G_t)``, ``tokens = Σ_rows (prompt + s·L)``: the cost
  model's ``6·params·tokens / (G_t · peak · MFU)``, linear in ``tokens / G_t``.
* push: ``W`` seconds per step (a broadcast: the same at every scale), measured.
* driver: ``D = d · B·n`` real seconds per step, unscaled (``flash.sim.accounting``: the time no
  simulated GPU worked: scoring, collation, transfers), proportional to the rows.

``k_e``, ``k_t``, ``W`` and ``d`` are fitted on the trace (``flash.app.plan_sim.fit_sim``).

The step loop (``simulate``) replays the controller: the scheduler admits a prompt while
``admitted < admission_limit(v, r, B)`` (``controllers/staleness.py``; ``v`` = weight pushes so far); a
step takes the ``B`` oldest finished groups once every group admitted at a version ``≤ t − ⌈r⌉``
has finished; then the driver's work and the train step (the engine goes on decoding meanwhile),
then the push, which waits for the engine's current step, and requeues every running sequence
(re-prefilled at its context). ``r = 0`` reduces it to the synchronous sum ``E + D + U + W``.

Thread terms (Amdahl, oversubscription, the CPU bound of ``flash.app.plan_model``) are left out:
a simulated GPU's time is the cost model's, slept, not computed on this machine's cores.
Departures: the engine advances one id per step (``sim.max_tokens_per_step`` > 1 only groups
steps); a group's samples are admitted together; ``select_batch``'s look-ahead past the current
step's deadline is not modelled; several engine actors are taken as one engine of all the
instances (they split the instances and the requests evenly: the same per-instance load).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from flash.controllers.staleness import admission_limit
from flash.sim import cost as costs


@dataclass(frozen=True)
class Shape:
    """What the recipe fixes: the cost model, samples per prompt, simulated tokens per id and per
    prompt, slots per instance."""

    cm: costs.CostModel
    n: int
    token_scale: int
    prompt_tokens: float
    max_num_seqs: int


@dataclass(frozen=True)
class Scale:
    """One candidate: what ``flash plan`` varies on a simulated run."""

    rollout_gpus: int
    train_gpus: int
    prompts: int
    async_ratio: float = 0.0


@dataclass(frozen=True)
class SimCosts:
    """Fitted on the trace (module docstring): the cost model's departures and the measured parts."""

    engine_factor: float = 1.0  # k_e
    train_factor: float = 1.0  # k_t
    push_s: float = 0.0  # W
    driver_per_row_s: float = 0.0  # d


@dataclass
class StepTimes:
    """Simulated seconds of each step, and the engine seconds and train seconds within it."""

    step_s: list[float] = field(default_factory=list)
    engine_s: list[float] = field(default_factory=list)
    train_s: list[float] = field(default_factory=list)


def instances(shape: Shape, rollout_gpus: int) -> int:
    """``I = G_r / tp`` engine instances (at least one)."""
    return max(1, rollout_gpus // shape.cm.tp)


def decode_s(shape: Shape, inst: int, running: int, context: float) -> float:
    """One engine step (one id: ``s`` simulated tokens) of ``running`` sequences with ``context``
    tokens in all, at one instance's share: ``decode_run(⌈R/I⌉, C / min(R, I), s)``."""
    if running <= 0:
        return 0.0
    return costs.decode_run_s(shape.cm, math.ceil(running / inst), context / min(running, inst), shape.token_scale)


def prefill_s(shape: Shape, inst: int, count: int, tokens: float) -> float:
    """Prefill of ``count`` admitted sequences holding ``tokens``, spread over ``min(count, I)`` instances."""
    return costs.prefill_s(shape.cm, tokens / min(count, inst)) if count > 0 else 0.0


def group_tokens(shape: Shape, group: list[int]) -> float:
    """Simulated tokens a group's rows put through the trainer: ``Σ (prompt + s·L)``."""
    return sum(shape.prompt_tokens + shape.token_scale * length for length in group)


def train_s(shape: Shape, tokens: float, train_gpus: int, k: SimCosts) -> float:
    """``U = k_t · train_step(tokens, G_t)``."""
    return k.train_factor * costs.train_step_s(shape.cm, tokens, train_gpus)


class _Group:
    """One prompt's ``n`` sequences, admitted together: ``done`` ids generated by each still running."""

    __slots__ = ("done", "ended", "lengths", "version")

    def __init__(self, version: int, lengths: list[int]):
        self.version, self.lengths = version, sorted(lengths)
        self.done = 0
        self.ended = bisect.bisect_right(self.lengths, 0)  # sequences finished (the lengths are sorted)

    def running(self) -> int:
        return len(self.lengths) - self.ended

    def advance(self) -> None:
        """One id for every running sequence."""
        self.done += 1
        while self.ended < len(self.lengths) and self.lengths[self.ended] <= self.done:
            self.ended += 1


class EngineState:
    """The simulated engine's queue and running groups, in groups (module docstring)."""

    def __init__(self, shape: Shape, scale: Scale, k: SimCosts):
        self.shape, self.k = shape, k
        self.inst = instances(shape, scale.rollout_gpus)
        self.slots = shape.max_num_seqs * self.inst
        self.waiting: list[_Group] = []
        self.live: list[_Group] = []
        self.finished: list[_Group] = []
        self.requeued = (0, 0.0)  # sequences and context tokens to re-prefill

    def context(self, g: _Group) -> float:
        return g.running() * (self.shape.prompt_tokens + self.shape.token_scale * g.done)

    def step(self) -> float:
        """Admit into free slots, decode one id for every running sequence; its seconds."""
        count, tokens = self.requeued
        self.requeued = (0, 0.0)
        used = sum(g.running() for g in self.live)
        while self.waiting and (used + len(self.waiting[0].lengths) <= self.slots or not used):
            g = self.waiting.pop(0)
            self.live.append(g)
            used += len(g.lengths)
            count, tokens = count + len(g.lengths), tokens + len(g.lengths) * self.shape.prompt_tokens
        seconds = prefill_s(self.shape, self.inst, count, tokens)
        seconds += decode_s(self.shape, self.inst, used, sum(self.context(g) for g in self.live))
        for g in self.live:
            g.advance()
        self.finished += [g for g in self.live if g.running() == 0]
        self.live = [g for g in self.live if g.running() > 0]
        return self.k.engine_factor * seconds

    def requeue(self) -> None:
        """A weight push: every running sequence is re-prefilled at its context on the next step."""
        self.requeued = (sum(g.running() for g in self.live), sum(self.context(g) for g in self.live))

    @property
    def idle(self) -> bool:
        return not self.live and not self.waiting and not self.requeued[0]


def batch_ready(eng: EngineState, step: int, B: int, r: float) -> bool:
    """``B`` finished groups, and none still out whose deadline is this step (``v ≤ t − ⌈r⌉``)."""
    due = step - math.ceil(r)
    late = any(g.version <= due for g in eng.live + eng.waiting)
    return len(eng.finished) >= B and not late


def take_batch(eng: EngineState, B: int) -> list[_Group]:
    """The ``B`` oldest finished groups (by admission version; stable in finishing order)."""
    eng.finished.sort(key=lambda g: g.version)
    batch, eng.finished = eng.finished[:B], eng.finished[B:]
    return batch


class StepLoop:
    """The controller's step loop against ``EngineState`` (module docstring), on two clocks: the
    controller's and the engine's (which runs ahead while the trainer trains)."""

    def __init__(self, draw: Iterator[list[int]], shape: Shape, scale: Scale, k: SimCosts):
        self.draw, self.shape, self.scale, self.k = draw, shape, scale, k
        self.eng = EngineState(shape, scale, k)
        self.t_ctl = self.t_eng = 0.0
        self.admitted = self.version = 0
        self.engine_s = 0.0  # engine seconds in the current step

    def admit(self) -> None:
        while self.admitted < admission_limit(self.version, self.scale.async_ratio, self.scale.prompts):
            self.eng.waiting.append(_Group(self.version, next(self.draw)))
            self.admitted += 1

    def engine_step(self, start: float) -> None:
        spent = self.eng.step()
        self.engine_s += spent
        self.t_eng = max(self.t_eng, start) + spent

    def get_batch(self, step: int) -> list[_Group]:
        """Run the engine until the step's batch is ready; the controller waits for it."""
        while not batch_ready(self.eng, step, self.scale.prompts, self.scale.async_ratio):
            self.admit()
            if self.eng.idle:
                raise RuntimeError("simulated engine idle before a batch was ready (admission below B?)")
            self.engine_step(self.t_ctl)
        self.t_ctl = max(self.t_ctl, self.t_eng)
        return take_batch(self.eng, self.scale.prompts)

    def overlap(self, until: float) -> None:
        """The engine decodes while the controller works until ``until`` (its step then ends past it)."""
        while self.t_eng < until:
            self.admit()
            if self.eng.idle:
                return
            self.engine_step(self.t_eng)

    def step(self, step: int) -> tuple[float, float]:
        """One train step: (its end on the controller's clock, its train seconds)."""
        batch = self.get_batch(step)
        rows = sum(len(g.lengths) for g in batch)
        train = train_s(
            self.shape, sum(group_tokens(self.shape, g.lengths) for g in batch), self.scale.train_gpus, self.k
        )
        self.t_ctl += self.k.driver_per_row_s * rows + train
        self.overlap(self.t_ctl)
        self.t_ctl = self.t_eng = max(self.t_ctl, self.t_eng) + self.k.push_s
        self.eng.requeue()
        self.version += 1
        return self.t_ctl, train


def simulate(draw: Iterator[list[int]], shape: Shape, scale: Scale, k: SimCosts, steps: int) -> StepTimes:
    """Seconds of each of ``steps`` train steps at ``scale``, groups drawn from ``draw`` (each a
    list of its ``n`` response lengths, in ids) in admission order."""
    loop, out, last = StepLoop(draw, shape, scale, k), StepTimes(), 0.0
    for t in range(steps):
        loop.engine_s = 0.0
        end, train = loop.step(t)
        out.step_s.append(end - last)
        out.engine_s.append(loop.engine_s)
        out.train_s.append(train)
        last = end
    return out
