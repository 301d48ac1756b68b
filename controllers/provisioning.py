"""Admission accounting with dynamic sampling: which prompts count against the staleness bound.

``StalenessManager`` admits while ``admitted < floor((t + 1 + r) * B)`` (docs/design.md invariant 2).
With filters on, a filtered group will never be trained, so counting it would leave batches short
forever (the bound is reached, the buffer never holds ``B`` groups). Here the count is of
*trainable* groups only:

    counted = regular admissions + promotions − filtered regular groups
            = trained + buffered + regular in flight

and admission asks ``can_admit(counted, t)``. The proof in ``controllers/staleness.py`` only ever
counts groups that get trained: a group admitted at version ``v`` had fewer than
``floor((v + 1 + r) * B)`` counted groups before it, and groups filtered later were counted then
and dropped since, so among groups that are trained it is still within the first
``floor((v + 1 + r) * B)``. The bound therefore holds unchanged; a filtered group simply frees its
slot for the next prompt (tested end to end in tests/integration/test_lifecycle.py).

Over-provisioning (``rollout.max_additional_prompts = X``): once the bound is reached, up to ``X``
*spare* prompts are generated beyond it, so that when a group is filtered a replacement is already
under way (DAPO keeps sampling until the batch is full). A spare does not count and is not seen by
batch selection. When a slot frees, a spare admitted **at the current version** is promoted
(finished spares first): a spare promoted at the version it was admitted at is indistinguishable
from a prompt admitted at that moment, so the proof above covers it. A spare cannot be promoted
after the policy moved on -- its tokens are older than a fresh admission's and batch selection
never planned for it -- so at each weight update the spares of older versions are aborted and
counted (``rollout/aborted/surplus``): over-provisioning trades that compute for full batches.
"""

from __future__ import annotations

from .staleness import StalenessManager


class Provisioning:
    """Counts for admission; the scheduler's lock guards every call."""

    def __init__(self, staleness: StalenessManager, max_additional: int = 0):
        if max_additional < 0:
            raise ValueError(f"max_additional_prompts must be >= 0, got {max_additional}")
        self.staleness = staleness
        self.max_additional = int(max_additional)
        self.counted = 0
        self._spares: dict[int, int] = {}  # prompt id -> admission version
        self._finished: set[int] = set()  # spares whose group is scored and kept by the filters

    def next_action(self, version: int) -> tuple[str, int | None] | None:
        """("promote", prompt id) | ("admit", None) | ("spare", None) | None (nothing allowed now)."""
        if self.staleness.can_admit(self.counted, version):
            pid = self._best_spare(version)
            return ("promote", pid) if pid is not None else ("admit", None)
        if len(self._spares) < self.max_additional:
            return ("spare", None)
        return None

    def _best_spare(self, version: int) -> int | None:
        current = [p for p, v in self._spares.items() if v == version]
        done = [p for p in current if p in self._finished]
        return min(done or current, default=None)

    def admitted(self, pid: int, version: int, spare: bool) -> None:
        if spare:
            self._spares[pid] = version
        else:
            self.counted += 1

    def promote(self, pid: int) -> None:
        del self._spares[pid]
        self._finished.discard(pid)
        self.counted += 1

    def demote(self, pid: int, version: int) -> None:
        """A regular group of the current ``version`` gives its slot back and becomes a spare of
        that version (tail batching: a finished spare takes the slot of a group still running, so
        the first groups to finish are kept). For the bound this is the group filtered and admitted
        again as a spare at the same version, both covered above."""
        self.counted -= 1
        self._spares[pid] = version

    def is_spare(self, pid: int) -> bool:
        return pid in self._spares

    def spare_finished(self, pid: int) -> None:
        self._finished.add(pid)

    def filtered(self, pid: int) -> None:
        """The group of ``pid`` was filtered: a regular one frees its slot, a spare its place."""
        if pid in self._spares:
            del self._spares[pid]
            self._finished.discard(pid)
        else:
            self.counted -= 1

    def expire(self, version: int) -> list[int]:
        """Spares admitted before ``version`` (the policy moved on): removed, to be aborted."""
        old = sorted(p for p, v in self._spares.items() if v < version)
        for pid in old:
            del self._spares[pid]
            self._finished.discard(pid)
        return old


class WaveGate:
    """When a finished response may be scored: at once (queue scheduling) or with its wave.

    A *wave* is the set of requests one admission pass submits together (with ``async_ratio=0``,
    exactly one train batch). With ``queue=False`` (the batch-then-score baseline) a wave's
    responses are held until every request in it has finished generating or been aborted, then
    all go to the reward pool at once -- the order of a plain "generate the batch, then score it"
    loop, kept so the benefit of queue scheduling can be measured in the same run.
    """

    def __init__(self, queue: bool):
        self.queue = queue
        self._left: dict[int, int] = {}
        self._held: dict[int, list] = {}

    def open(self, wave: int, size: int) -> None:
        if not self.queue and size > 0:
            self._left[wave], self._held[wave] = size, []

    def finished(self, wave: int, out) -> list:
        """``out`` finished generating; the outputs that may be scored now."""
        if self.queue:
            return [out]
        self._held[wave].append(out)
        return self.resolved(wave, 1)

    def resolved(self, wave: int, count: int) -> list:
        """``count`` requests of ``wave`` ended (finished or aborted); outputs released, if any."""
        if self.queue or count == 0:
            return []
        self._left[wave] -= count
        if self._left[wave] > 0:
            return []
        del self._left[wave]
        return self._held.pop(wave)

    def held(self) -> int:
        return sum(len(v) for v in self._held.values())
