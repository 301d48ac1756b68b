"""BufferProducer: puts groups into a BufferService exactly once, in order, with backpressure.

Every put carries ``(producer id, seq)`` with ``seq`` = 0, 1, 2, ... and the service stores a
producer's puts only in that order: a ``seq`` at or below the last stored one is a retry
(``duplicate``: acknowledged, not stored again); one above the next expected is refused (``gap``:
an earlier put was refused). So a producer may keep up to ``window`` puts in flight and, when the
service answers ``full``, park a ``wait_space`` request and then resend from the refused put on
(go-back-N): nothing is stored twice, nothing is skipped, one producer's groups stay in order.

``window = 1`` (the default) is the strict form: ``put`` returns once its group is stored. With a
window of ``w``, ``put`` returns at once while fewer than ``w`` puts are unacknowledged, and else
waits until at most ``w // 2`` are (so it wakes once per burst of acks, not once per put) --
round trips overlap, which is what a streaming producer wants -- and ``flush`` (also run by
``close``) waits for the rest. Unacknowledged groups stay in this object; if the service goes silent, ``put``
raises ``BufferUnavailable`` and the next ``put`` or ``flush`` resends them with their own seqs.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from buffers.buffer import BufferClosed
from buffers.rpc import BufferUnavailable, Rpc
from buffers.types import Group
from buffers.wire import WireError, encode_group


@dataclass
class _Put:
    group: Group
    frame: bytes
    rid: int = -1  # the latest send's request id: replies to older sends are stale


class BufferProducer:
    def __init__(self, address: str, max_frame_mb: float = 64.0, rpc_timeout_s: float = 10.0,
                 wait_ms: int = 500, window: int = 1):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.max_frame_bytes = int(max_frame_mb * (1 << 20))
        self.rpc_timeout_s, self.wait_ms, self.window = rpc_timeout_s, wait_ms, window
        self._rpc = Rpc(address, self.max_frame_bytes)
        self.producer_id = uuid.uuid4().hex
        self._inflight: OrderedDict[int, _Put] = OrderedDict()  # seq -> unacknowledged put
        self._next_seq = 0
        self._stalled = False  # the service went silent: resend everything before going on
        self._blocked_at: float | None = None
        self._lock = threading.Lock()
        self.counters = {"puts": 0.0, "duplicates": 0.0, "full": 0.0, "retries": 0.0, "blocked_s": 0.0}

    def put(self, group: Group, timeout: float | None = None) -> None:
        """Hand ``group`` over; blocks while the window is full of unacknowledged puts.

        TimeoutError: the service stayed full for ``timeout`` s; this group is not stored (earlier
        ones in flight still will be). ``put`` of the same Group object again is a retry, not a
        second copy.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            if any(p.group is group for p in self._inflight.values()):
                self.counters["retries"] += 1
                self._stalled = True
            else:
                self._enqueue(group)
            try:
                if len(self._inflight) >= self.window:  # down to half: fewer, larger waits
                    self._settle(self.window // 2, deadline)
            except TimeoutError:
                self._drop_tail(group)
                self._stalled = True  # earlier puts refused with it go out again on the next put
                raise

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every put so far is acknowledged (stored)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._settle(0, deadline)

    def _enqueue(self, group: Group) -> None:
        frame = encode_group(group)
        if len(frame) > self.max_frame_bytes:
            raise WireError("oversized", f"group {group.prompt_id} encodes to {len(frame)} bytes > "
                                         f"{self.max_frame_bytes}; raise buffer.max_frame_mb")
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        self._inflight[seq] = put = _Put(group, frame)
        if not self._stalled:
            self._send(seq, put)

    def _send(self, seq: int, put: _Put) -> None:
        put.rid = self._rpc.send({"op": "put", "producer": self.producer_id, "seq": seq}, payload=put.frame)

    def _resend_from(self, first: int) -> None:
        for seq, put in self._inflight.items():
            if seq >= first:
                self._send(seq, put)

    def _settle(self, most: int, deadline: float | None) -> None:
        """Handle replies until at most ``most`` puts are unacknowledged."""
        if self._stalled and self._inflight:
            self._resend_from(next(iter(self._inflight)))
        self._stalled = False
        while len(self._inflight) > most:
            reply = self._rpc.recv(self.rpc_timeout_s, limit=1 << 16)
            if reply is None:
                self._stalled = True
                raise BufferUnavailable(f"no answer from the buffer service at {self._rpc.address} in "
                                        f"{self.rpc_timeout_s}s; {len(self._inflight)} puts unacknowledged "
                                        "(the next put or flush resends them)")
            self._on_reply(reply, deadline)
            while len(self._inflight) > most and (reply := self._rpc.recv_nowait(limit=1 << 16)) is not None:
                self._on_reply(reply, deadline)

    def _on_reply(self, reply: dict, deadline: float | None) -> None:
        if reply.get("status") == "acks":  # a burst's answers, in order
            for rid, seq, status in reply["acks"]:
                self._on_reply({"rid": rid, "seq": seq, "status": status}, deadline)
            return
        seq, status = reply.get("seq"), reply.get("status")
        put = self._inflight.get(seq)
        if put is None or reply.get("rid") != put.rid:
            return  # answers a send we have since repeated (or a wait_space we gave up on)
        if status in ("stored", "duplicate"):
            del self._inflight[seq]
            self.counters["puts"] += 1
            self.counters["duplicates"] += status == "duplicate"
            if self._blocked_at is not None:
                self.counters["blocked_s"] += time.monotonic() - self._blocked_at
                self._blocked_at = None
        elif status == "closed":
            self._inflight.clear()
            raise BufferClosed("put on a closed SampleBuffer (service)")
        elif status == "full":
            self.counters["full"] += 1
            self._blocked_at = self._blocked_at if self._blocked_at is not None else time.monotonic()
            self._wait_space(deadline)
            self._resend_from(seq)
        elif status == "gap":  # an earlier send never arrived: resend everything in flight
            self._resend_from(next(iter(self._inflight)))
        else:
            raise WireError("bad_schema", f"unexpected put reply {reply!r}")

    def _wait_space(self, deadline: float | None) -> None:
        """Park on the service until it has room (replies to other sends meanwhile are stale)."""
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise TimeoutError("SampleBuffer service full for the whole put timeout")
        wait_ms = self.wait_ms if left is None else max(1, min(self.wait_ms, int(left * 1000)))
        rid = self._rpc.send({"op": "wait_space", "wait_ms": wait_ms})
        reply = self._rpc.wait(rid, wait_ms / 1000 + self.rpc_timeout_s, limit=1 << 16)
        if reply is None:
            self._stalled = True
            raise BufferUnavailable(f"no answer from the buffer service at {self._rpc.address}")
        if reply.get("status") == "closed":
            self._inflight.clear()
            raise BufferClosed("put on a closed SampleBuffer (service)")

    def _drop_tail(self, group: Group) -> None:
        """After a timeout: the newest put (this group) was refused, so forget it and reuse its seq."""
        if self._inflight:
            seq = next(reversed(self._inflight))
            if self._inflight[seq].group is group:
                del self._inflight[seq]
                self._next_seq = seq
        self._blocked_at = None

    def wake(self) -> None:
        """SampleBuffer API: nothing to wake on the producer side."""

    def stats(self) -> dict[str, float]:
        return dict(self.counters) | {"unacknowledged": float(len(self._inflight))}

    def close(self) -> None:
        """Flush what is in flight, then release the socket."""
        try:
            if self._inflight:
                self.flush(timeout=self.rpc_timeout_s)
        finally:
            self._rpc.close()
