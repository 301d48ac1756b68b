"""One response's reward under one wall-clock deadline, across all of its tests.

``reward.response_deadline_s`` (flash.app.schema): however many sandbox runs a reward makes for one
response (a code row with many stdin tests runs one per test), scoring it ends within this many
seconds. The caller of a reward opens ``response_deadline(seconds)`` around the call -- the
scheduler's reward threads (``RolloutCore.score``) and each reward worker (``RewardScorer.score``)
-- and every sandbox call made in that thread (``flash.rewards.sandbox.execute``) asks
``sandbox_timeout`` for its own timeout:

- time left below the call's timeout: the call gets the time left, so its child is killed at the
  deadline (the sandbox's own timeout kill: the whole call's processes and cgroups), and a call
  that ends ``timeout`` so raises ``RewardDeadline``;
- no time left: ``RewardDeadline`` before anything runs.

Either way ``Deadline.hit`` is set, so the caller names the outcome even when the reward caught the
exception itself: the response scores 0.0 with outcome ``reward_deadline``, counted per run
(``reward/deadline`` in every step's metrics, ``reward_deadline`` in ``summary.json``).

Standard library only, as the sandbox's other modules (they load without the project's
dependencies).
"""

from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

OUTCOME = "reward_deadline"


class RewardDeadline(Exception):
    """Scoring one response ran past ``reward.response_deadline_s``."""


@dataclass
class Deadline:
    """The deadline of the response being scored in this thread: ``at`` (``time.monotonic``), the
    ``seconds`` it allowed, and whether a sandbox call was cut short or refused by it (``hit``)."""

    at: float
    seconds: float
    hit: bool = False

    def passed(self) -> RewardDeadline:
        """Mark the deadline hit; the exception to raise."""
        self.hit = True
        return RewardDeadline(f"scoring one response took over reward.response_deadline_s={self.seconds:g}s")


_local = threading.local()


def current() -> Deadline | None:
    """The deadline of the response this thread is scoring, if any."""
    return getattr(_local, "deadline", None)


@contextmanager
def response_deadline(seconds: float | None) -> Iterator[Deadline | None]:
    """Score one response within ``seconds`` (None: no deadline of its own) in this thread; an
    enclosing deadline that ends sooner still holds."""
    outer = current()
    if seconds is None or not math.isfinite(seconds):
        yield outer
        return
    at = time.monotonic() + seconds
    deadline = Deadline(outer.at, outer.seconds) if outer is not None and outer.at < at else Deadline(at, seconds)
    _local.deadline = deadline
    try:
        yield deadline
    finally:
        _local.deadline = outer
        if outer is not None and deadline.hit:
            outer.hit = True


def score_within(seconds: float | None, score: Callable[..., Any], *args: Any) -> Any:
    """``score(*args)`` under ``response_deadline(seconds)``; ``RewardDeadline`` when the deadline
    passed, even where the reward caught the deadline's exception itself."""
    with response_deadline(seconds) as deadline:
        value = score(*args)
    if deadline is not None and deadline.hit:
        raise RewardDeadline(deadline.seconds)
    return value


def sandbox_timeout(timeout_s: float) -> tuple[float, Deadline | None]:
    """The timeout a sandbox call gets: ``timeout_s``, or the time the response has left when
    that is less (then with the ``Deadline`` that cut it); ``RewardDeadline`` when none is left."""
    deadline = current()
    if deadline is None:
        return timeout_s, None
    left = deadline.at - time.monotonic()
    if left <= 0:
        raise deadline.passed()
    return (left, deadline) if left < timeout_s else (timeout_s, None)
