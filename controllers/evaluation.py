"""Evaluation through the scheduler core (``RolloutCore.evaluate_samples``): one unit per item (a
response, an episode) launched through the core's workflow on the same engine as training, its
outputs answered by the collector, the units scored concurrently on the core's reward threads.
An evaluation unit is never a sample of the lifecycle: its id starts with ``eval/``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from flash.engine.base import SamplingParams
from .workflows.base import Unit, request_seed

if TYPE_CHECKING:
    from .scheduler import RolloutCore


def evaluate_samples(
    core: RolloutCore,
    items: list,
    params: SamplingParams,
    tag: str,
    seed: int,
    on_progress: Callable[[int], None] | None = None,
    on_scored: Callable[[int], None] | None = None,
) -> list:
    """The scored samples of ``items``, in item order. ``on_progress(done)``: the units answered so
    far, about once a second while they generate, and all of them before scoring;
    ``on_scored(done)``: the units scored so far, about once a second while they are scored."""
    units = [
        Unit(
            f"eval/{tag}/{i}",
            -1,
            i,
            item,
            core.source.encode(item.prompt),
            SamplingParams(**{**params.__dict__, "seed": request_seed(seed, 10**6 + i, 0)}),
        )
        for i, item in enumerate(items)
    ]
    answers = core.inflight.answers
    with core._lock:
        core.inflight.eval_units.update((u.id, u) for u in units)
    core.workflow.launch(units)
    with core._lock:
        told = time.monotonic()
        while not all(u.id in answers for u in units):
            core.check()
            core._lock.wait(timeout=0.5)
            if on_progress is not None and time.monotonic() - told >= 1.0:
                on_progress(sum(u.id in answers for u in units))
                told = time.monotonic()
        outs = [answers.pop(u.id) for u in units]
        for u in units:
            core.inflight.eval_units.pop(u.id, None)
    if on_progress is not None:
        on_progress(len(units))
    # scored concurrently on the reward threads (a code reward's sandbox runs dominate an eval)
    return core._rewards.map(core.workflow.finish, units, outs, on_done=on_scored)
