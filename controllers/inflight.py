"""In-flight tracking: the prompts the scheduler core has started and not yet handed on, and the
evaluation units not yet answered.

``InFlight`` is a part of ``flash.controllers.scheduler.RolloutCore``. A pending prompt (``Pending``)
keeps what its units are built from (item, data index, admission version, length cap, meta) and
what came back so far (the indices of its finished requests, their scored samples, a spare's
parked group). ``units`` builds a prompt's units with their seeds; ``first_output`` tells a unit's
first finished output from one asked again around an engine restart; ``lost`` names what an engine
restart lost (``RolloutCore.requeue_lost``); ``state_dict`` is the prompts-in-flight part of a
checkpoint. The core's lock guards every call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flash.buffers import Group, Sample
from .workflows.base import Unit, parse_request_id, request_id, request_seed
from flash.engine.base import GenerationOutput, SamplingParams


@dataclass
class Pending:
    item: Any
    data_index: int
    version: int
    wave: int
    requests: int  # n + redundancy
    finished: list[int] = field(default_factory=list)  # request indices kept (first n to finish)
    samples: dict[int, Sample] = field(default_factory=dict)  # request index -> scored sample
    parked: Group | None = None  # a spare's kept group, waiting for promotion
    cap: int | None = None  # max_new_tokens of its requests when below the run's (tail batching)
    meta: dict = field(default_factory=dict)  # copied into each sample's meta (e.g. the round)

    def group(self, prompt_id: int) -> Group:
        """The kept samples in request order, renumbered 0..n-1 (``meta['request']`` keeps k)."""
        samples = [self.samples[k] for k in sorted(self.samples)]
        for i, s in enumerate(samples):
            s.sample_index = i
        return Group(prompt_id=prompt_id, admitted_version=self.version, data_index=self.data_index, samples=samples)


class InFlight:
    """Pending prompts by id (``prompts``) and evaluation units by id (``eval_units``, their
    outputs in ``answers`` until the evaluation takes them)."""

    def __init__(self, params: SamplingParams, seed: int, requests: int):
        self.params, self.seed = params, seed
        self.requests = requests  # units per prompt: n + redundancy
        self.prompts: dict[int, Pending] = {}
        self.eval_units: dict[str, Unit] = {}
        self.answers: dict[str, GenerationOutput] = {}
        self._received: set[str] = set()  # unit ids finished for pending prompts

    def open(
        self, prompt_id: int, item: Any, data_index: int, version: int, wave: int, cap: int | None, meta: dict
    ) -> None:
        """Prompt ``prompt_id`` is in flight: its ``requests`` units start."""
        self.prompts[prompt_id] = Pending(item, data_index, version, wave, self.requests, cap=cap, meta=dict(meta))

    def units(self, prompt_id: int, ids: list[int], ks) -> list[Unit]:
        """Units ``ks`` of a pending prompt: seeds from (run seed, prompt id, k); its ``cap`` (tail
        batching) lowers max_new_tokens."""
        p = self.prompts[prompt_id]
        knobs = {**self.params.__dict__, **({"max_new_tokens": p.cap} if p.cap is not None else {})}
        return [
            Unit(
                request_id(prompt_id, k),
                prompt_id,
                k,
                p.item,
                ids,
                SamplingParams(**{**knobs, "seed": request_seed(self.seed, prompt_id, k)}),
                version=p.version,
                data_index=p.data_index,
                meta=dict(p.meta),
            )
            for k in ks
        ]

    def first_output(self, rid: str) -> bool:
        """True for the first finished output of unit ``rid`` of a pending prompt (it is taken);
        False for one already taken or of a prompt no longer pending."""
        if rid in self._received or parse_request_id(rid)[0] not in self.prompts:
            return False
        self._received.add(rid)
        return True

    def forget_ended(self) -> None:
        """Drop the taken ids of prompts no longer pending (bounded memory)."""
        self._received = {r for r in self._received if parse_request_id(r)[0] in self.prompts}

    def lost(
        self, generating: Callable[[str], bool], encode: Callable[[str], list[int]], only: set[str] | None
    ) -> list[Unit]:
        """Every unit still generating whose output was not taken yet, of an evaluation or of a
        pending prompt (of ``only`` when given): what an engine restart lost."""
        lost = [u for u in self.eval_units.values() if u.id not in self.answers and (only is None or u.id in only)]
        for pid, p in sorted(self.prompts.items()):
            ks = [
                k
                for k in range(p.requests)
                if request_id(pid, k) not in self._received
                and generating(request_id(pid, k))
                and (only is None or request_id(pid, k) in only)
            ]
            if ks:
                lost += self.units(pid, encode(p.item.prompt), ks)
        return lost

    def state_dict(self, live: Callable[[str], bool], is_spare: Callable[[int], bool]) -> list[dict]:
        """The prompts in flight (regular or spare, generating, scoring, or a spare's parked
        group), each with the requests of it still ``live``."""
        return [
            {
                "prompt_id": pid,
                "data_index": p.data_index,
                "version": p.version,
                "spare": is_spare(pid),
                "requests": [k for k in range(p.requests) if live(request_id(pid, k))],
                "cap": p.cap,
                "meta": dict(p.meta),
            }
            for pid, p in sorted(self.prompts.items())
        ]
