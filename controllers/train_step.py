"""One train step on collated batches, written once for the controller and for `flash replay`.

    reference call → recompute_prox → advantages (+ the critic's step) → reference wait → train

``train_batch`` trains one whole batch (the plain step); ``train_stream`` backpropagates a batch
group by group as the groups come (the stream trainer, RollPacker) and steps the optimizer once at
the end. Both take a ``phase(name)`` context manager that wraps each part: the controller passes its
timed phases (``AsyncController.phase``), the replay of a run (flash.app.replay) ``no_phase``, so a
replay trains exactly as the run did, call for call.

The roles are Ray actor handles (``h.method.remote(...)``): the trainer, and, when placed, the critic
(``gae``) and the reference role (a KL penalty against it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import ray

from flash import algos
from flash.algos.proximal import prox_approx_error
from flash.buffers import Group
from flash.train.batch import TrainBatch, collate, flatten

Phase = Callable[[str], AbstractContextManager]


@contextmanager
def no_phase(name: str):
    """A phase that times nothing (the replay's)."""
    yield


@dataclass(frozen=True)
class StepRoles:
    """The actors a train step calls (critic and reference: None when not placed)."""

    trainer: Any
    critic: Any = None
    reference: Any = None


@dataclass(frozen=True)
class StepPlan:
    """How a step trains: the proximal mode (``prox_mode``), the advantage estimator's config, and
    whether to measure the ``approx`` proximal policy against the real recompute."""

    prox: str
    advantage: dict[str, Any]
    measure_prox_error: bool = False


@dataclass
class StepOut:
    train: dict[str, float]  # the trainer's metrics, the critic's beside them, ``no_update``
    prox: Any  # the proximal logprobs the step used (None: computed in the train forward)
    rollout: dict[str, float] = field(default_factory=dict)  # rollout/prox_approx_error when measured


def train_batch(
    roles: StepRoles,
    batch: TrainBatch,
    t: int,
    plan: StepPlan,
    phase: Phase = no_phase,
    before_trainer: Callable[[], None] | None = None,
) -> StepOut:
    """Train step ``t`` on ``batch``. The reference role's logprobs are asked for first, so they
    overlap the rest; ``before_trainer`` runs next (the controller's colocated engines go to sleep)."""
    ref_call = reference_call(roles.reference, batch)
    if before_trainer is not None:
        before_trainer()
    with phase("recompute_prox"):
        prox = proximal(plan.prox, batch, roles.trainer)
        measured = approx_error(plan, batch, roles.trainer, t)
    with phase("advantages"):
        adv, critic_step = advantages(plan.advantage, batch, roles.critic)
    ref = reference_wait(ref_call, phase)
    with phase("train"):
        metrics = ray.get(roles.trainer.train_step.remote(batch, adv, prox, ref))
        if critic_step is not None:  # the critic trained beside the policy
            metrics.update(ray.get(critic_step))
    return StepOut({**metrics, "no_update": no_update([adv])}, prox, measured)


def train_stream(
    roles: StepRoles, parts: Iterable[list[Group]], advantage: dict[str, Any], pad_id: int, phase: Phase = no_phase
) -> tuple[list[Group], dict[str, float]]:
    """(groups trained, the trainer's metrics) of the stream trainer over ``parts`` (each a list of
    groups, in the order they finished). Each part is backpropagated as soon as it comes, one part
    in flight while the next is collated; ``Trainer.accumulate`` weights each by its share of the
    batch's aggregate, so the update equals the plain step on the whole batch (up to float summation
    order). Validation keeps it to async_ratio 0 and group-local estimators, where a group's
    advantages and proximal policy (= behaviour) are final when the group is.

    Phases: ``get_batch`` spans the streaming (the trainer works inside it, one part behind the
    rollout); ``train`` is the tail after the last part (its backward and the optimizer step)."""
    ray.get(roles.trainer.begin_step.remote())
    groups, pending, advs = [], None, []
    with phase("get_batch"):
        for group in parts:
            part = collate(flatten(group), pad_id=pad_id)
            adv, _ = advantages(advantage, part, roles.critic)
            advs.append(adv)
            if pending is not None:
                ray.get(pending)  # keep one part in flight: the actor runs them in order
            ref = reference_wait(reference_call(roles.reference, part), phase)
            pending = roles.trainer.accumulate.remote(part, adv, part.behav_logp, ref)
            groups += group
    with phase("train"):
        assert pending is not None  # a step streams at least one part
        ray.get(pending)
        metrics = ray.get(roles.trainer.finish_step.remote())
    return groups, {**metrics, "no_update": no_update(advs)}


def no_update(advs: list) -> float:
    """``train/no_update``: 1.0 when every advantage of the step (``advs``: its parts' tensors) is 0
    -- every group had equal reward, for the group-relative estimators -- so the policy-gradient
    loss and its gradient are 0 and only a KL or entropy term, if any, trains; else 0.0."""
    return float(not any(bool(a.any()) for a in advs))


def proximal(mode: str, batch: TrainBatch, trainer):
    """The proximal logprobs of a step under ``mode`` (``prox_mode``): behaviour's, None (fused
    into the train forward, or approximated there: the trainer's ``settings.prox`` says which) or
    the trainer's current ones from a forward of their own."""
    if mode == "separate":
        return ray.get(trainer.logprobs.remote(batch))
    return {"behav": batch.behav_logp, "fused": None, "approx": None}[mode]


def approx_error(plan: StepPlan, batch: TrainBatch, trainer, t: int) -> dict[str, float]:
    """``algo.measure_prox_error``: the real recompute beside the approximation; their mean
    absolute difference over the batch's tokens (the approximation at the batch's first step)."""
    if not plan.measure_prox_error or plan.prox != "approx":
        return {}
    recomputed = ray.get(trainer.logprobs.remote(batch))
    return {"rollout/prox_approx_error": prox_approx_error(batch.behav_logp, recomputed, batch.versions, batch.mask, t)}


def reference_call(reference, batch: TrainBatch):
    """The reference role's logprobs of ``batch``, asked for now and awaited later (None without
    one: the trainer's local copy, if any, serves the KL penalty)."""
    return None if reference is None else reference.logprobs.remote(batch)


def reference_wait(call, phase: Phase = no_phase):
    """The reference role's logprobs (None without one); the wait is the ``reference`` phase."""
    if call is None:
        return None
    with phase("reference"):
        return ray.get(call)


def advantages(advantage: dict[str, Any], batch: TrainBatch, critic=None):
    """(advantages, the critic's train step or None) from the configured estimator; with a critic
    (``gae``) its values come first and its own train step is launched at once (it needs only
    the batch, values and returns)."""
    knobs = {k: v for k, v in advantage.items() if k != "name"}
    values = critic_step = None
    if critic is not None:
        values = ray.get(critic.values.remote(batch))
        returns = algos.gae_returns(batch.rewards, values, batch.mask, knobs.get("gamma", 1.0), knobs.get("lam", 1.0))
        critic_step = critic.train_step.remote(batch, returns, values)
    adv = algos.compute_advantages(
        advantage["name"], batch.rewards, batch.group_ids, batch.mask, values=values, **knobs
    )
    return adv, critic_step
