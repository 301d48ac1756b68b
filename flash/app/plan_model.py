"""The planner's cost model (``flash plan``): small pure functions, each with its formula.

A run's trace (``flash.app.plan.load_trace``) is reduced to a handful of fitted costs, measured at
the trace's own settings (threads per role, async ratio); this module predicts the seconds per
train step of another setting from them. Notation (per train step, B prompts × n samples):

* engine: one batched decode iteration costs ``a`` seconds plus ``c`` per live sequence, so a
  *round* that runs ``I`` iterations and generates ``K`` tokens takes ``E = a·I + c·K`` (continuous
  batching: every iteration advances all live sequences by one token). A synchronous round runs
  until its longest response ends, ``I = L_max``: that is the long-tail bubble.
* trainer: ``U = u0 + u1·rows·W`` where ``W`` is the padded width (prompt + longest response: the
  batch is padded to its longest row) and ``rows = B·n``.
* update: ``W_u`` = suspend + push_weights + resume; ``O`` = the rest of the step (advantages,
  bookkeeping); ``g0`` = what ``get_batch`` waits beyond the engine's busy time (collector polls,
  the last rewards).
* threads: a role's time scales with Amdahl's law, ``f(t) = (1 − p) + p / t`` (``p`` = the part of
  its work that runs in parallel), so ``time(t) = time(t_ref) · f(t) / f(t_ref)``; when the roles
  overlap (async) and ask for more threads than the ``C`` cores, both slow by ``(e + t) / C``.

Overlap (``step_time``): with ratio ``r`` the scheduler may admit ``min(r, 1)`` of the next batch
while the current one trains (docs/design.md invariant 2), so that share of the next round's engine
work hides behind ``U + W_u``:

    T = O + U + W_u + (E + g0) − min(min(r, 1)·(E + g0), U + W_u)

``r = 0`` gives the synchronous sum; ``r ≥ 1`` gives ``O + max(U + W_u, E + g0)``.

CPU bound (``cpu_bound_step``): overlapped roles share the cores, and so do the processes no
phase timer sees (the controller's collector and reward threads, reward workers, Ray). A
synchronous run hides that: each role runs while the other waits. So runs record CPU seconds per
step (the engine's process tree, the trainer's, the driver's, the reward workers'); CPU per busy
second ``ρ`` is fitted per role, and an overlapped step can be no shorter than its serial phases
plus the CPU of everything else spread over the ``C`` cores:

    T ≥ O + W_u + (ρ_e·E_ref + ρ_t·U_ref + d) / C

(``E_ref``, ``U_ref``: the round's engine and trainer seconds at the trace's threads, since CPU
seconds, unlike wall seconds, do not shrink with threads; ``d``: the CPU per step of the driver
and of the reward pool's workers, sandbox runs included).

Tail batching (RollPacker, ``simulate_tail``): the rounds are simulated from the recorded groups'
response lengths: a short round launches ``ceil(o·B)`` prompts, cuts a group when a response
reaches the threshold ``τ`` (a fresh prompt takes its slot), ends when ``B`` groups have finished,
and sends every group it did not keep to a long queue; a long round runs ``B`` queued groups at
full length. Cut work is spent: its tokens count in the round's ``K``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Costs:
    """Fitted costs at the trace's reference threads (``engine_threads``, ``trainer_threads``)."""

    a: float  # engine seconds per decode iteration (fixed part)
    c: float  # engine seconds per generated token
    u0: float  # trainer seconds per step (fixed part)
    u1: float  # trainer seconds per padded token (rows × width)
    update_s: float  # suspend + push_weights + resume
    other_s: float  # the rest of a step: advantages, bookkeeping
    g0: float  # get_batch wait beyond the engine's busy time
    engine_threads: int
    trainer_threads: int
    cores: int
    prompt_len: float = 0.0  # mean prompt tokens (padded width = prompt + longest response)
    cpu_engine: float = 0.0  # ρ_e: engine CPU seconds per busy second (0: the trace has no CPU counts)
    cpu_train: float = 0.0  # ρ_t: trainer CPU seconds per train second
    cpu_driver_s: float = 0.0  # d: the driver's and the reward pool's CPU seconds per step


@dataclass(frozen=True)
class Setting:
    """One candidate: what ``flash plan`` varies."""

    async_ratio: float = 0.0
    engine_threads: int = 0  # 0: auto, as flash.app.settings.resolve_threads
    trainer_threads: int = 0
    replicas: int = 1
    tail: bool = False
    tail_threshold: float = math.inf  # τ, tokens
    tail_overprovision: float = 1.0  # o ≥ 1
    tail_long_queue: int = 0  # a long round once the queue holds this many groups; 0: B
    tail_long_every: int = 0  # also one every k steps when the queue is not empty; 0: off


@dataclass
class Trace:
    """What a run dir says (``flash.app.plan.load_trace``), reduced to what the model needs."""

    costs: Costs
    groups: list[list[int]]  # every trained group's n response lengths
    steps: list[list[list[int]]]  # per steady step: its groups' lengths
    setting: Setting  # the setting the run had (threads as configured: 0 = auto)
    B: int
    measured_step_s: float  # mean seconds per steady step


@dataclass
class Round:
    """One simulated rollout round (= one train step): its engine iterations and tokens, and the
    trained rows' longest response."""

    iterations: float
    tokens: float
    rows: int
    max_len: float
    long: bool = False
    cut_groups: int = 0


@dataclass
class Prediction:
    step_s: float
    parts: dict[str, float] = field(default_factory=dict)


def amdahl(threads: float, p: float) -> float:
    """Relative time at ``threads``: ``f(t) = (1 − p) + p / t`` (1 at one thread)."""
    return (1.0 - p) + p / max(threads, 1e-9)


def scale(seconds: float, t_from: float, t_to: float, p: float) -> float:
    """``seconds`` measured at ``t_from`` threads, at ``t_to`` threads: ``s · f(t_to) / f(t_from)``."""
    return seconds * amdahl(t_to, p) / amdahl(t_from, p)


def auto_threads(cores: int, async_ratio: float, engine: int = 0, trainer: int = 0) -> tuple[int, int]:
    """(engine, trainer) torch threads on ``cores`` cores, the rule a run starts its roles with
    (``flash.app.settings.resolve_threads``) and the planner predicts with: all cores each when sync
    (phases alternate), halves when async (they overlap); explicit values (non-zero) win."""
    if async_ratio == 0:
        e, t = cores, cores
    else:
        e, t = max(1, cores // 2), max(1, cores - cores // 2)
    return engine or e, trainer or t


def oversubscription(engine_threads: int, trainer_threads: int, cores: int, overlap: bool) -> float:
    """Slowdown of both roles while they run together: ``max(1, (e + t) / C)``; 1 when they alternate."""
    return max(1.0, (engine_threads + trainer_threads) / cores) if overlap else 1.0


def round_engine_s(iterations: float, tokens: float, a: float, c: float) -> float:
    """``E = a·I + c·K``: decode iterations pay a fixed cost, every live sequence a token's cost."""
    return a * iterations + c * tokens


def replica_engine_s(iterations: float, tokens: float, a: float, c: float, replicas: int) -> float:
    """N replicas split the round's requests: each runs all ``I`` iterations on ``K / N`` tokens
    (``a``, ``c`` already at the replica's threads)."""
    return round_engine_s(iterations, tokens / max(1, replicas), a, c)


def train_s(rows: int, width: float, u0: float, u1: float) -> float:
    """``U = u0 + u1·rows·width`` (the batch is padded to its longest row)."""
    return u0 + u1 * rows * width


def step_time(engine_s: float, train: float, update: float, other: float, g0: float, r: float) -> float:
    """Seconds per step under async ratio ``r`` (the module docstring's overlap formula)."""
    gen = engine_s + g0
    hidden = min(min(max(r, 0.0), 1.0) * gen, train + update)
    return other + train + update + gen - hidden


def cpu_bound_step(engine_ref_s: float, train_ref_s: float, update: float, other: float, k: Costs) -> float:
    """The shortest an overlapped step can be on ``k.cores`` cores (module docstring): its serial
    phases plus every role's CPU seconds over the cores; 0 when the trace has no CPU counts."""
    if not (k.cpu_engine or k.cpu_train):
        return 0.0
    return other + update + (k.cpu_engine * engine_ref_s + k.cpu_train * train_ref_s + k.cpu_driver_s) / k.cores


def sync_round(lengths: list[list[int]]) -> Round:
    """A plain round: every group runs to its end; ``I = L_max``, ``K = Σ L``."""
    flat = [x for g in lengths for x in g]
    return Round(
        iterations=float(max(flat, default=0)),
        tokens=float(sum(flat)),
        rows=len(flat),
        max_len=float(max(flat, default=0)),
    )


def short_round(
    groups: list[list[int]], B: int, tau: float, refill: Iterator[list[int]] | None = None
) -> tuple[Round, list[list[int]], int]:
    """A short round (controllers/tail_batching.py) over the launched ``groups`` (``o·B`` of them),
    in decode iterations: a group whose responses all end within ``τ`` finishes at its longest
    one; a group with a longer response is cut when it reaches ``τ`` and, when ``refill`` is
    given, a fresh group from it starts in its slot at that iteration. The round ends when ``B``
    groups have finished (or when nothing is left running). Returns (the round, the groups cut to
    the long queue: every launched group not kept, how many groups it trains)."""
    live = [(0.0, g) for g in groups]  # (start iteration, group)
    done: list[tuple[float, list[int]]] = []
    cut: list[list[int]] = []
    spent: list[tuple[float, list[int]]] = []  # every group that ran, with its start
    while live and len(done) < B:
        live.sort(key=lambda sg: sg[0] + min(max(sg[1]), tau))
        start, g = live.pop(0)
        spent.append((start, g))
        if max(g) <= tau:
            done.append((start + max(g), g))
        else:
            cut.append(g)
            if refill is not None:
                live.append((start + tau, next(refill)))
    end = max((t for t, _ in done[:B]), default=max((s + min(max(g), tau) for s, g in spent), default=0.0))
    spent += live
    cut += [g for _, g in live]  # still running when the round was full
    tokens = sum(max(0.0, min(x, tau, end - s)) for s, g in spent for x in g)
    kept = [g for _, g in done[:B]]
    rows = sum(len(g) for g in kept)
    max_len = float(max((max(g) for g in kept), default=0))
    return Round(float(end), float(tokens), rows, max_len, cut_groups=len(cut)), cut, len(kept)


def long_round(queue: list[list[int]]) -> Round:
    """A long round: the queued groups together at full length (``I`` = the longest of them)."""
    rnd = sync_round(queue)
    rnd.long = True
    return rnd


def simulate_tail(groups: list[list[int]], B: int, s: Setting, rounds: int = 400, seed: int = 0) -> list[Round]:
    """Monte Carlo of ``rounds`` tail-batching steps, drawing launched groups (with replacement)
    from the recorded ``groups`` (each a list of its n response lengths). A long round runs ``B``
    queued groups when the queue holds ``tail_long_queue`` (0: ``B``), or every ``tail_long_every``
    steps when set and the queue is not empty (controllers/tail_policy.long_round_due)."""
    rng = random.Random(seed)
    launch = max(B, math.ceil(s.tail_overprovision * B))
    trigger = s.tail_long_queue or B
    queue: list[list[int]] = []
    out: list[Round] = []
    for i in range(rounds):
        periodic = s.tail_long_every > 0 and (i + 1) % s.tail_long_every == 0 and queue
        if len(queue) >= trigger or periodic:
            take, queue = queue[:B], queue[B:]
            out.append(long_round(take))
            continue
        draws = iter(lambda: rng.choice(groups), None)  # endless: refills of cut slots
        rnd, cut, _ = short_round([rng.choice(groups) for _ in range(launch)], B, s.tail_threshold, draws)
        queue += cut
        out.append(rnd)
    return out
