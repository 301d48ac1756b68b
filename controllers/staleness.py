"""Admission control: the staleness bound is kept by admitting prompts, not by dropping work.

With async ratio ``r`` and ``B`` prompts per train step, while the policy is at version ``t`` (the
number of weight updates pushed so far) the scheduler admits a new prompt only while

    admitted < floor((t + 1 + r) * B)                                   (docs/design.md invariant 2)

so a prompt admitted at version ``v`` lies among the first ``floor((v + 1 + r) * B)`` admissions.
The batch of step ``t`` may then hold only samples with version >= t - ceil(r): a prompt admitted at
version ``v <= t - ceil(r) - 1`` is among the first ``floor((t - ceil(r) + r) * B) <= t * B``
admissions, and steps ``0..t-1`` consumed ``t * B`` groups -- provided the batches took old groups
early enough. Taking any ``B`` finished groups is not enough (a slow old group can be overtaken
until more than ``B`` old groups are due at once), and taking strictly in admission order blocks on
the slowest group. ``select_batch`` takes the oldest finished groups and checks, earliest deadline
first, that every group still out can meet its deadline ``version + ceil(r)`` at ``B`` groups per
step; only when it cannot does the controller wait for more groups to finish. Only the next
``ceil(r)`` steps need checking: every group already admitted has a version <= t, so for later
deadlines the admission formula itself guarantees room. ``r = 0`` admits exactly ``B`` prompts per
version and so is plain synchronous on-policy training.

With dynamic sampling, ``admitted`` counts trainable groups only (a filtered group frees its slot;
spare prompts beyond the bound are promoted only at their own version): ``controllers/provisioning``
carries the argument over, and tests/integration/test_lifecycle.py checks it on random schedules.
"""

from __future__ import annotations

import math


def admission_limit(version: int, async_ratio: float, prompts_per_step: int) -> int:
    """``floor((version + 1 + r) * B)``: how many prompts may have been admitted in total while the
    policy is at ``version`` (the admission formula above; ``flash plan``'s simulator runs it too)."""
    return math.floor((version + 1 + async_ratio) * prompts_per_step + 1e-9)


class StalenessManager:
    def __init__(self, async_ratio: float, prompts_per_step: int):
        if async_ratio < 0:
            raise ValueError(f"async_ratio must be >= 0, got {async_ratio}")
        self.r = float(async_ratio)
        self.batch = int(prompts_per_step)

    @property
    def max_staleness(self) -> int:
        """ceil(r): the largest ``t - version`` a trained sample may have."""
        return math.ceil(self.r)

    def admission_limit(self, version: int) -> int:
        """How many prompts may have been admitted in total while the policy is at ``version``."""
        return admission_limit(version, self.r, self.batch)

    def can_admit(self, admitted: int, version: int) -> bool:
        return admitted < self.admission_limit(version)

    def must_train_by(self, step: int) -> int:
        """Groups admitted at a version <= this value must be in the batch of ``step``."""
        return step - self.max_staleness

    def select_batch(self, step: int, finished: list[int], pending: list[int]) -> list[int] | None:
        """Indices into ``finished`` (group versions) to train at ``step``, or None to wait.

        ``pending`` holds the admission versions of groups not finished yet (a lower bound on
        their final versions). Oldest finished first; the choice is accepted when, for each of the
        next ``ceil(r)`` steps ``s``, the groups left over with deadline <= s number at most
        ``(s - step) * B`` -- the room the steps between have.
        """
        if len(finished) < self.batch:
            return None
        order = sorted(range(len(finished)), key=lambda i: (finished[i], i))
        chosen, left = order[: self.batch], [finished[i] for i in order[self.batch :]]
        left += list(pending)
        for s in range(step, step + self.max_staleness):
            due = sum(1 for v in left if v + self.max_staleness <= s)
            if due > (s - step) * self.batch:
                return None
        return sorted(chosen)
