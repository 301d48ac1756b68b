"""SampleBuffer: where rollout producers leave finished groups and the trainer takes batches.

The API is the one the distributed (zmq + msgpack) buffer keeps: ``put`` from any producer,
``get_batch`` from the controller, ``stats`` for metrics, ``close`` to release waiters. This is the
in-process implementation (threads, one lock): enough while producers live in the driver.

Bounded: ``put`` blocks while the buffer holds ``capacity`` groups (backpressure on producers
rather than an unbounded queue or dropped work). ``get_batch`` takes a ``select`` rule so the
controller's staleness logic decides *which* groups make a batch, re-evaluated on every ``put``
and on ``wake`` (called when something outside the buffer that ``select`` reads has changed).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from .types import Group

Select = Callable[[list[Group]], list[int] | None]


class BufferClosed(RuntimeError):
    """The buffer was closed while a caller waited on it."""


class SampleBuffer:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._groups: list[Group] = []
        self._cond = threading.Condition()
        self._closed = False
        self._puts = 0
        self._gets = 0
        self._put_wait_s = 0.0
        self._get_wait_s = 0.0

    def put(self, group: Group, timeout: float | None = None) -> None:
        """Add a finished group; blocks while the buffer is full (backpressure)."""
        start = time.monotonic()
        with self._cond:
            ok = self._cond.wait_for(lambda: self._closed or len(self._groups) < self.capacity, timeout)
            if self._closed:
                raise BufferClosed("put on a closed SampleBuffer")
            if not ok:
                raise TimeoutError(f"SampleBuffer full ({self.capacity} groups) for {timeout}s")
            self._groups.append(group)
            self._puts += 1
            self._put_wait_s += time.monotonic() - start
            self._cond.notify_all()

    def get_batch(self, n: int, select: Select | None = None, timeout: float | None = None) -> list[Group]:
        """Remove and return a batch: ``select(groups)`` picks indices, or None to keep waiting.

        The default rule takes the ``n`` oldest-version groups once ``n`` are present.
        """
        select = select or (lambda groups: _oldest(groups, n))
        start = time.monotonic()
        picked: list[int] | None = None

        def ready() -> bool:
            nonlocal picked
            if self._closed:
                return True
            picked = select(list(self._groups))
            return picked is not None

        with self._cond:
            if not self._cond.wait_for(ready, timeout):
                raise TimeoutError(f"no batch of {n} groups within {timeout}s")
            if picked is None:
                raise BufferClosed("get_batch on a closed SampleBuffer")
            keep = set(picked)
            batch = [self._groups[i] for i in sorted(keep)]
            self._groups = [g for i, g in enumerate(self._groups) if i not in keep]
            self._gets += len(batch)
            self._get_wait_s += time.monotonic() - start
            self._cond.notify_all()
            return batch

    def wake(self) -> None:
        """Re-evaluate waiting ``get_batch`` rules (their inputs changed outside the buffer)."""
        with self._cond:
            self._cond.notify_all()

    def drain(self) -> list[Group]:
        """Remove and return everything (end of run, checkpoint)."""
        with self._cond:
            out, self._groups = self._groups, []
            self._cond.notify_all()
            return out

    def snapshot(self, also: Callable[[], Any] | None = None) -> tuple[list[Group], Any]:
        """A copy of the contents, plus ``also()`` called under the same lock (a checkpoint's one
        consistent view of the buffer and whatever feeds it)."""
        with self._cond:
            return list(self._groups), (also() if also is not None else None)

    def restore(self, groups: list[Group]) -> None:
        """Put back a checkpoint's groups (before producers start; capacity is not enforced, so
        nothing a checkpoint holds can be refused)."""
        with self._cond:
            self._groups.extend(groups)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def stats(self) -> dict[str, float]:
        with self._cond:
            return {
                "depth": float(len(self._groups)),
                "groups_in": float(self._puts),
                "groups_out": float(self._gets),
                "put_wait_s": self._put_wait_s,
                "get_wait_s": self._get_wait_s,
            }


def _oldest(groups: list[Group], n: int) -> list[int] | None:
    if len(groups) < n:
        return None
    order = sorted(range(len(groups)), key=lambda i: (groups[i].version, groups[i].prompt_id))
    return order[:n]
