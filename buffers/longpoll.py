"""The buffer service's long-polls: ``wait_space`` (answered once the buffer has room) and ``meta``
(answered once the store's epoch moves past the client's ``since``), parked until their condition
holds or their deadline passes (``flash.buffers.service`` answers them from its thread).

A long-poll waits at most ``MAX_WAIT_MS``; at most ``max_waiters`` are parked in all and
``per_client`` per client (its zmq identity); one over either cap is refused ``too_many_waiters``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass

from .store import KeyedSampleBuffer
from .wire import WireError

MAX_WAIT_MS = 60_000  # a long-poll's longest wait: a client wanting longer asks again


@dataclass
class Parked:
    """A long-poll the service answers later: when its condition holds or at its deadline."""

    identity: bytes
    op: str
    rid: int
    since: int
    deadline: float


class LongPolls:
    """The parked long-polls of one service over its store. ``lock``: the service's, held while the
    list changes, so its stats see a request parked or answered, never half of either."""

    def __init__(self, buffer: KeyedSampleBuffer, max_waiters: int, per_client: int, lock: threading.Lock):
        self.buffer, self.max_waiters, self.per_client, self._lock = buffer, max_waiters, per_client, lock
        self._parked: list[Parked] = []

    def __len__(self) -> int:
        return len(self._parked)

    def identities(self) -> set[bytes]:
        """The clients with a long-poll parked (waiting on the service: not idle)."""
        return {p.identity for p in self._parked}

    def soonest(self, default: float) -> float:
        """The earliest deadline parked (``default`` when none is)."""
        return min([p.deadline for p in self._parked], default=default)

    def park_or_answer(self, identity: bytes, msg: dict, since: int) -> dict | None:
        """The answer to a ``wait_space`` or ``meta`` request if it is due now, else None (parked)."""
        if not 0 <= msg["wait_ms"] <= MAX_WAIT_MS:
            raise WireError("bad_value", f"{msg['op']}.wait_ms must be in [0, {MAX_WAIT_MS}], got {msg['wait_ms']}")
        p = Parked(identity, msg["op"], msg["rid"], since, time.monotonic() + msg["wait_ms"] / 1000)
        answer = self.answer(p, timed_out=msg["wait_ms"] == 0)
        if answer is not None:
            return answer
        if len(self._parked) >= self.max_waiters:
            raise WireError("too_many_waiters", f"{self.max_waiters} long-polls already parked")
        if Counter(q.identity for q in self._parked)[identity] >= self.per_client:
            raise WireError("too_many_waiters", f"this client has {self.per_client} long-polls parked")
        with self._lock:
            self._parked.append(p)
        return None

    def answer(self, p: Parked, timed_out: bool) -> dict | None:
        """The reply to a parked request if it is due now, else None."""
        epoch, closed, metas = self.buffer.meta()
        if p.op == "wait_space":
            if closed or len(metas) < self.buffer.capacity:
                return {"status": "closed" if closed else "ok"}
            return {"status": "timeout"} if timed_out else None
        if epoch == p.since and not timed_out:
            return None
        return {
            "status": "ok",
            "epoch": epoch,
            "closed": closed,
            "capacity": self.buffer.capacity,
            "groups": [m.to_wire() for m in metas],
        }

    def due(self) -> list[tuple[bytes, dict]]:
        """(identity, reply) of every parked request due now, each no longer parked."""
        if not self._parked:
            return []
        now, keep, served = time.monotonic(), [], []
        for p in self._parked:
            answer = self.answer(p, timed_out=now >= p.deadline)
            if answer is None:
                keep.append(p)
            else:
                answer["rid"] = p.rid
                served.append((p.identity, answer))
        with self._lock:  # no longer parked before its reply: a client that reads stats next sees it gone
            self._parked = keep
        return served
