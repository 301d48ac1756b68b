"""Admission: which prompts start, and when.

``Admission`` is a part of the scheduler core (``flash.controllers.scheduler.RolloutCore``) that owns
the admission state: the policy version, how many prompts were admitted (the next prompt id), the
data position in the task's prompt stream, the admission waves, and the accounting of trainable
groups and spares (``Provisioning``, which asks the staleness bound of ``controllers/staleness.py``
whether one more prompt may start). The core's admission thread asks it what is allowed now
(``next_action``), registers each new prompt (``new_prompt``) and launches the prompt's
``n + redundancy`` units through the workflow (prompt replication: each its own id and seed, so
engines or a router may spread them freely); at a new policy version (``move_to``) more prompts
may start and older spares end. Its part of a checkpoint is ``state_dict``.

The core's lock guards every call. Request seeds depend only on (run seed, prompt id, request
index), never on timing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .provisioning import Provisioning
from .staleness import StalenessManager


@dataclass
class PromptSource:
    """The task's prompt stream as the scheduler needs it: item, token ids, reward."""

    item: Callable[[int], Any]  # data index -> TaskItem
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str] | None  # None where the workflow scores (episodes, agents)
    reward: Callable[[Any, str], float] | None
    guard: Any = None  # flash.guards.InputGuard: skips (or rejects) malformed/empty/too long prompts

    def take(self, index: int) -> tuple[int, Any, list[int]]:
        """The first usable prompt at data position >= ``index``: (its index, item, token ids)."""
        if self.guard is not None:
            return self.guard.take(index, self.item, self.encode)
        item = self.item(index)
        return index, item, self.encode(item.prompt)


class Admission:
    """The admission state (module doc): version, admissions, data position, waves, provisioning."""

    def __init__(
        self, staleness: StalenessManager, source: PromptSource, max_additional: int = 0, start_index: int = 0
    ):
        self.prov = Provisioning(staleness, max_additional)
        self.source = source
        self.version = 0  # the policy version admission runs at
        self.admitted = 0  # prompts admitted so far, spares included: the next prompt's id
        self.next_index = start_index  # data position of the next prompt
        self.waves = 0  # admission passes so far (``WaveGate``)
        self.stopped = threading.Event()  # set by ``stop_admission``: no prompt starts any more

    def next_action(self) -> tuple[str, int | None] | None:
        """What admission may do now (``Provisioning.next_action`` at the current version)."""
        return self.prov.next_action(self.version)

    def new_wave(self) -> int:
        """The number of the admission pass starting now."""
        wave, self.waves = self.waves, self.waves + 1
        return wave

    def new_prompt(self, spare: bool) -> int:
        """Register one more admitted prompt (a spare, or counted against the bound); its id."""
        pid = self.admitted
        self.prov.admitted(pid, self.version, spare)
        self.admitted += 1
        return pid

    def take(self) -> tuple[int, Any, list[int]]:
        """The next usable prompt of the stream (``PromptSource.take``: the input guard skips bad
        rows), moving the data position past it: (data index, item, token ids)."""
        index, item, ids = self.source.take(self.next_index)
        self.next_index = index + 1
        return index, item, ids

    def move_to(self, version: int) -> list[int]:
        """The policy moved to ``version``: more prompts may start; the ids of the spares of older
        versions, which end (``Provisioning.expire``)."""
        self.version = version
        return self.prov.expire(version)

    def state_dict(self) -> dict:
        """Data position, admissions, version, waves and the admission accounting (counted groups)."""
        return {
            "admitted": self.admitted,
            "next_index": self.next_index,
            "version": self.version,
            "waves": self.waves,
            "provisioning": {"counted": self.prov.counted},
        }

    def load_state_dict(self, state: dict) -> None:
        self.admitted, self.next_index = state["admitted"], state["next_index"]
        self.version = state["version"]
        self.waves = state.get("waves", 0)
        self.prov.counted = state.get("provisioning", {}).get("counted", self.admitted)
