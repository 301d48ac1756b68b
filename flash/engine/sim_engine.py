"""The simulated rollout engine (``rollout.engine: sim``): the engine contract with GPU time.

``SimBatcher`` steps like ``TorchEngine`` (continuous batching: admit into free slots, one batched
decode, finished sequences leave at once; the same interrupt modes and weight-update requeue) but
computes nothing: each step's *time* comes from the cost model (``flash.sim.cost``) and the thread
sleeps it, scaled by ``sim.time_scale``, less the real time the step's own bookkeeping took (so
drawing tokens for thousands of sequences on a loaded CPU does not lengthen the simulated step);
the busy spans it reports are the scaled GPU time alone, so bookkeeping that runs past it
(``late_s``) is not taken for GPU work (``flash.sim.accounting``); each response's length, ids and logprobs are drawn from
its request's seed (``flash.sim.workload``). ``EngineLoop`` drives it, so pausing, waiters and
errors behave exactly as for the torch engine, and ``SimEngineWorker`` is the same actor API.

One actor stands for ``instances`` engine instances of ``tp`` GPUs each (data parallel): it holds
``max_num_seqs`` slots per instance and spreads its running sequences evenly over them, so a step
costs one instance's decode at ``ceil(running / instances)`` sequences. A step advances every
running sequence by up to ``max_tokens_per_step`` ids (stopping at the first one to finish, so no
sequence waits past its end), each id standing for ``token_scale`` simulated tokens.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from flash.engine.base import INTERRUPT_MODES, GenerationOutput, GenerationRequest
from flash.engine.loop_actor import LoopActor
from flash.engine.torch_engine import BatchState, derive_seed
from flash.sim import cost as costs
from flash.sim.config import SimConfig, cost_model, instances
from flash.sim.workload import draw_tokens, load_lengths, observed_length, prompt_factor, response_length
from flash.usage import SpanRecorder
from flash.weights.group import UpdateReceiver

WEIGHT_NAME = "sim.version"  # the one tensor a simulated trainer pushes (its step count)
MAX_CONTEXT = 1 << 30  # the cost model has no context limit of its own


@dataclass
class SimSettings:
    """What one simulated engine needs: its cost model and share of the GPUs, the workload."""

    cm: costs.CostModel
    instances: int
    time_scale: float
    token_scale: int = 1
    prompt_tokens: int = 0
    length_median: float = 0.0
    length_sigma: float = 1.0
    max_tokens_per_step: int = 8
    prompt_sigma: float = 0.0
    lengths: tuple[tuple[int, ...], ...] = ()  # observed length groups (simulated tokens); empty: the lognormal

    @classmethod
    def from_config(cls, sim: SimConfig, replicas: int = 1) -> SimSettings:
        return cls(
            cost_model(sim),
            instances(sim, replicas),
            sim.time_scale,
            sim.token_scale,
            sim.prompt_tokens,
            sim.length_median,
            sim.length_sigma,
            sim.max_tokens_per_step,
            sim.prompt_sigma,
            load_lengths(sim.lengths) if sim.lengths else (),
        )


@dataclass(eq=False)
class _Seq:
    req: GenerationRequest
    seed: int
    target: int = 0  # token ids this response will have
    rng: random.Random = field(default_factory=random.Random)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def reset(self, s: SimSettings) -> None:
        """Back to the seed: the same length and ids again (interrupt mode ``restart``)."""
        cap = self.req.params.max_new_tokens
        self.rng = random.Random(self.seed)
        ids = list(self.req.prompt_ids)
        factor = prompt_factor(ids, s.prompt_sigma)
        if s.lengths:
            self.target = observed_length(self.rng, s.lengths, ids, factor / s.token_scale, cap)
        else:
            median = s.length_median / s.token_scale if s.length_median else cap / 4
            self.target = response_length(self.rng, median * factor, s.length_sigma, cap)
        self.tokens, self.logprobs, self.versions = [], [], []

    def output(self, reason: str) -> GenerationOutput:
        r = self.req
        return GenerationOutput(
            r.request_id, list(r.prompt_ids), list(self.tokens), list(self.logprobs), list(self.versions), reason
        )


class SimBatcher(BatchState):
    """A ``TorchEngine`` stand-in whose steps sleep the cost model's time (see the module doc)."""

    def __init__(self, settings: SimSettings, vocab_size: int, max_num_seqs: int, seed: int):
        self.s, self.vocab_size, self.seed = settings, vocab_size, seed
        self.slots = max_num_seqs * settings.instances
        self._running: list[_Seq] = []
        self._waiting: deque[_Seq] = deque()
        self._ids: set[str] = set()
        self._version, self.admitting, self._asleep = 0, True, None
        self.tokens_generated = self.decode_steps = 0
        self.sim_busy_s = self.sim_sync_s = 0.0  # simulated seconds computing / receiving weights
        self.step_costs: list[float] = []  # simulated seconds of each step (determinism checks)
        self.late_s = 0.0  # real seconds steps ran past their scaled time (bookkeeping slower than the GPU)
        self.spans = SpanRecorder()  # wall spans of scaled GPU time: [step start, + simulated s × time_scale]

    # ---- the TorchEngine surface EngineLoop drives ---------------------------------------------

    @property
    def can_step(self) -> bool:
        return bool(self._running or (self.admitting and self._waiting))

    def add_request(self, req: GenerationRequest) -> None:
        if req.request_id in self._ids:
            raise ValueError(f"request {req.request_id!r} is already in the engine")
        seq = _Seq(req, req.params.seed if req.params.seed is not None else derive_seed(self.seed, req.request_id))
        seq.reset(self.s)
        self._ids.add(req.request_id)
        self._waiting.append(seq)

    def step(self) -> list[GenerationOutput]:
        """Admit (prefill), then up to ``max_tokens_per_step`` decode iterations; sleep their time."""
        start = (time.monotonic(), time.time())
        cost = self._admit() if self.admitting else 0.0
        finished: list[GenerationOutput] = []
        if self._running:
            spent, finished = self._decode()
            cost += spent
        self.sim_busy_s += cost
        self.step_costs.append(cost)
        self._pace(start, cost)
        return finished

    def abort(self, request_ids: list[str] | None = None) -> list[GenerationOutput]:
        hit = (lambda q: True) if request_ids is None else (lambda q, ids=set(request_ids): q.req.request_id in ids)
        outs = [q.output("abort") for q in [*self._running, *self._waiting] if hit(q)]
        self._running = [q for q in self._running if not hit(q)]
        self._waiting = deque(q for q in self._waiting if not hit(q))
        self._ids -= {o.request_id for o in outs}
        return outs

    def preempt(self, mode: str) -> None:
        """As ``TorchEngine.preempt``: ``restart`` rewinds every partial response, ``wait`` stops admission."""
        if mode not in INTERRUPT_MODES:
            raise ValueError(f"unknown interrupt mode {mode!r}; expected one of {INTERRUPT_MODES}")
        if mode == "restart":
            self._requeue_running()
            for q in self._waiting:
                q.reset(self.s)
        elif mode == "wait":
            self.admitting = False

    def resume(self) -> None:
        if self._asleep is not None:
            raise RuntimeError("the engine is asleep; call wake_up() before resume()")
        self.admitting = True

    def update_weights(self, named_tensors: Mapping | Iterable, version: int) -> None:
        """Take every pushed tensor, sleep the cost model's weight-push time, requeue the running
        sequences (their KV was made by the old weights: re-prefilled at admission)."""
        if self._asleep is not None:
            raise RuntimeError("the engine is asleep; call wake_up() before update_weights()")
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        for name, _ in items:
            if name != WEIGHT_NAME:
                raise KeyError(f"unknown parameter {name!r}: the simulated engine holds only {WEIGHT_NAME!r}")
        start, sync = (time.monotonic(), time.time()), costs.weight_sync_s(self.s.cm)
        self.sim_sync_s += sync
        self._pace(start, sync)
        self._requeue_running()
        self._version = version

    def sleep(self, level: int = 1) -> dict:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self._asleep is None:
            self._requeue_running()
            self._asleep = {"level": level, "kv_bytes_released": 0, "weights": "simulated", "device": "sim"}
        return self._asleep

    def wake_up(self) -> dict:
        info, self._asleep = self._asleep, None
        return info or {"level": 0}

    # ---- internals ------------------------------------------------------------------------------
    def _pace(self, start: tuple[float, float], simulated_s: float) -> None:
        """Sleep until ``simulated_s × time_scale`` real seconds after ``start`` (monotonic, wall)."""
        scaled = simulated_s * self.s.time_scale
        if scaled > 0:
            self.spans.add(start[1], start[1] + scaled)
        left = start[0] + scaled - time.monotonic()
        if left > 0:
            time.sleep(left)
        else:
            self.late_s -= left

    def _sim_context(self, q: _Seq) -> int:
        prompt = self.s.prompt_tokens or len(q.req.prompt_ids) * self.s.token_scale
        return prompt + len(q.tokens) * self.s.token_scale

    def _requeue_running(self) -> None:
        self._waiting.extendleft(reversed(self._running))
        self._running = []

    def _admit(self) -> float:
        """Fill free slots from the queue; the prefill time of the newcomers (spread over instances)."""
        new = []
        while self._waiting and len(self._running) + len(new) < self.slots:
            new.append(self._waiting.popleft())
        if not new:
            return 0.0
        self._running += new
        tokens = sum(self._sim_context(q) for q in new)
        return costs.prefill_s(self.s.cm, tokens / min(len(new), self.s.instances))

    def _decode(self) -> tuple[float, list[GenerationOutput]]:
        running, s = self._running, self.s
        k = min(s.max_tokens_per_step, min(q.target - len(q.tokens) for q in running))
        busy = min(len(running), s.instances)
        per_batch = math.ceil(len(running) / s.instances)
        context = sum(self._sim_context(q) for q in running) / busy
        cost = costs.decode_run_s(s.cm, per_batch, context, k * s.token_scale)
        self._extend(running, k)
        finished, keep = [], []
        for q in running:
            if len(q.tokens) >= q.target:
                finished.append(q.output("length" if q.target >= q.req.params.max_new_tokens else "stop"))
                self._ids.discard(q.req.request_id)
            else:
                keep.append(q)
        self._running = keep
        self.tokens_generated += k * len(running)
        self.decode_steps += k * s.token_scale
        return cost, finished

    def _extend(self, running: list[_Seq], k: int) -> None:
        """``k`` more ids for every running response, drawn at once (``draw_tokens``); an id that is
        one of its response's stop tokens moves to the next id, and a response that ends before
        the cap ends on its first stop token."""
        ids, logprobs = draw_tokens(
            np.array([q.seed & _U64 for q in running], dtype=np.uint64),
            np.array([len(q.tokens) for q in running]),
            k,
            self.vocab_size,
        )
        stop_ids = {t for q in running for t in q.req.params.stop_token_ids}
        hit = np.isin(ids, list(stop_ids)).any(axis=1).tolist() if stop_ids else [False] * len(running)
        for q, row, lps, fix in zip(running, ids.tolist(), logprobs.tolist(), hit):
            stops = q.req.params.stop_token_ids
            if fix:  # rare: an id that is some response's stop token
                row = [_avoid(t, stops, self.vocab_size) for t in row]
            if stops and len(q.tokens) + k == q.target and q.target < q.req.params.max_new_tokens:
                row[-1] = stops[0]
            q.tokens += row
            q.logprobs += lps
            q.versions += [self._version] * k


_U64 = (1 << 64) - 1


def _avoid(token: int, stops: list[int], vocab_size: int) -> int:
    """The first id from ``token`` on (wrapping) that is not a stop token."""
    while token in stops and len(stops) < vocab_size:
        token = (token + 1) % vocab_size
    return token


def model_vocab(model_path: str) -> int:
    """The vocabulary size from the checkpoint's ``config.json`` (no weights are loaded)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    return int(config.get("vocab_size") or config.get("text_config", {})["vocab_size"])


class SimEngineWorker(LoopActor, UpdateReceiver):
    """The simulated engine as an actor: the same methods as ``EngineWorker``; ``sim`` is a
    ``SimSettings`` (or the ``sim:`` config section and ``replicas``, the engine actors sharing it)."""

    def __init__(
        self,
        model_path: str,
        max_num_seqs: int,
        seed: int,
        threads: int,
        sim: SimSettings | SimConfig | None = None,
        replicas: int = 1,
    ):
        settings = sim if isinstance(sim, SimSettings) else SimSettings.from_config(sim or SimConfig(), replicas)
        self.batcher = SimBatcher(settings, model_vocab(model_path), max_num_seqs, seed)
        self._start_loop(self.batcher, self.batcher.vocab_size, MAX_CONTEXT)

    def get_weights(self) -> dict:
        return {WEIGHT_NAME: torch.tensor([float(self.batcher.version)])}

    def stats(self) -> dict:
        b = self.batcher
        return {
            **super().stats(),
            "sim_busy_s": b.sim_busy_s,
            "sim_sync_s": b.sim_sync_s,
            "sim_late_s": b.late_s,
            "sim_tokens": float(b.tokens_generated * b.s.token_scale),
        }

    def busy_spans(self) -> list[list[float]]:
        """The scaled GPU time of the steps since the last call (the loop's spans, which hold the
        bookkeeping too, are dropped)."""
        self.loop.busy_spans()
        return self.batcher.spans.drain()

    def step_costs(self) -> list[float]:
        """Simulated seconds of every step so far (outside the contract: determinism checks)."""
        return list(self.batcher.step_costs)

    def _mu_device(self) -> torch.device:
        """Its one weight (the version it serves) is a host tensor, wherever it is placed."""
        return torch.device("cpu")

    def _mu_shapes(self) -> dict:
        return {WEIGHT_NAME: (1,)}
