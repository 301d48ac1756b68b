"""``algo.recompute_prox``, interpreted once: where a step's proximal logprobs come from.

The config names a policy (``RecomputeProx``); the controller, the trainer, the value checks and
`flash replay` read only what it means at the run's async ratio (``ProxSource``, ``prox_mode``)
and in the trainer's forward (``trainer_prox``).
"""

from __future__ import annotations

from typing import Literal, get_args

# auto: recompute only when samples may be off-policy; always: a forward of its own; never: behav;
# approx: AReaL's interpolation between behav and current by version (flash.algos.proximal)
RecomputeProx = Literal["auto", "always", "never", "approx"]
# behav (prox = behaviour), fused (in the train forward), separate (its own forward and phase),
# approx (interpolated in the train forward, flash.algos.proximal)
ProxSource = Literal["behav", "fused", "separate", "approx"]
PROX_SOURCES: tuple[str, ...] = get_args(ProxSource)


def prox_mode(mode: RecomputeProx, async_ratio: float) -> ProxSource:
    """Where the proximal logprobs come from, for the config's ``algo.recompute_prox``.

    ``auto``: at r = 0 every sample is on-policy and prox equals behav (up to the train–inference
    mismatch), so behav is used, exactly as a plain synchronous loop does; at r > 0 the recompute
    is fused into the train forward (exact with one optimizer step per batch, one forward saved).
    ``always``: a separate forward before the step (its own timed phase). ``never``: behav.
    ``approx``: AReaL's interpolation between behav and the current policy by token version, in the
    train forward (``flash.algos.proximal``; no recompute at all).
    """
    if mode == "auto":
        return "fused" if async_ratio > 0 else "behav"
    sources: dict[str, ProxSource] = {"always": "separate", "approx": "approx"}
    return sources.get(mode, "behav")


def trainer_prox(mode: RecomputeProx) -> Literal["fused", "approx"]:
    """What the trainer makes of a step given no proximal logprobs (``TrainerSettings.prox``):
    the approximation under ``approx``, else the detached logprobs of its own forward (fused)."""
    return "approx" if prox_mode(mode, 0.0) == "approx" else "fused"
