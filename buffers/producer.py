"""BufferProducer: puts groups into a BufferService exactly once, in order, with backpressure.

Every group carries ``(producer id, seq)`` with ``seq`` = 0, 1, 2, ... and the service stores a
producer's groups only in that order: a ``seq`` at or below the last one it decided is a retry
(``duplicate``: acknowledged, not stored again); one above the next expected is refused (``gap``:
an earlier group was refused). So a producer may keep up to ``window`` groups in flight and, when
the service answers ``full``, park a ``wait_space`` request and then resend from the refused group
on (go-back-N): nothing is stored twice, nothing is skipped, one producer's groups stay in order.

Batching (as Kafka's producer does): a put message carries a run of consecutive seqs -- up to
``batch_groups`` groups or ``batch_kb`` KiB -- so the per-message costs (a send and a receive on
each side, a wake-up of the service's loop, an acknowledgement) are paid once per batch instead of
once per group. A batch goes out when it is full, when the oldest group in it has waited
``linger_ms`` (a background thread sends it, so a lone put is not held back longer), when the
window fills (``put`` is about to wait for acknowledgements), or on ``flush``/``close``.
``linger_ms = 0`` sends every put at once. The service answers each batch with one status per
group, so one bad group is refused by name (``rejected_<reason>``) while the others are stored.

``window = 1`` (the default) is the strict form: ``put`` returns once its group is stored (and
linger never applies: the put waits for its answer). With a window of ``w``, ``put`` returns at
once while fewer than ``w`` groups are unacknowledged, and else waits until at most ``w // 2`` are
(so it wakes once per burst of acks, not once per put) -- round trips overlap, which is what a
streaming producer wants -- and ``flush`` (also run by ``close``) waits for the rest.
Unacknowledged groups stay in this object; if the service goes silent, ``put`` raises
``BufferUnavailable`` and the next ``put`` or ``flush`` resends them with their own seqs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from .auth import ClientKeys
from .buffer import BufferClosed
from .rpc import BufferUnavailable, Rpc
from .types import Group
from .wire import REASONS, WireError, encode_group

log = logging.getLogger(__name__)

DONE = ("stored", "duplicate")  # the service has decided the seq: it leaves the window


@dataclass
class _Put:
    group: Group
    frame: bytes
    rid: int = -1  # the latest send's request id: replies to older sends are stale


class BufferProducer:
    def __init__(
        self,
        address: str,
        max_frame_mb: float = 64.0,
        rpc_timeout_s: float = 10.0,
        wait_ms: int = 500,
        window: int = 1,
        batch_groups: int = 16,
        batch_kb: int = 1024,
        linger_ms: float = 1.0,
        keys: ClientKeys | None = None,
    ):
        if window < 1 or batch_groups < 1 or batch_kb < 1 or linger_ms < 0:
            raise ValueError(
                f"need window >= 1, batch_groups >= 1, batch_kb >= 1, linger_ms >= 0; got "
                f"{window}, {batch_groups}, {batch_kb}, {linger_ms}"
            )
        self.max_frame_bytes = int(max_frame_mb * (1 << 20))
        self.rpc_timeout_s, self.wait_ms, self.window = rpc_timeout_s, wait_ms, window
        self.batch_groups, self.batch_bytes, self.linger_s = batch_groups, batch_kb << 10, linger_ms / 1000
        self._rpc = Rpc(address, self.max_frame_bytes, keys=keys)
        # issued by the service (a client cannot pick another's id); asked before any put is in flight
        self.producer_id = self._rpc.call({"op": "hello"}, rpc_timeout_s, limit=1 << 12)["producer"]
        self._inflight: OrderedDict[int, _Put] = OrderedDict()  # seq -> unacknowledged put (sent or not)
        self._held: set[int] = set()  # id() of the groups in _inflight (alive there: no id is reused)
        self._pending: list[int] = []  # seqs not sent yet: the batch being filled
        self._pending_bytes, self._pending_since = 0, 0.0
        self._next_seq = 0
        self._stalled = False  # the service went silent: resend everything before going on
        self._blocked_at: float | None = None
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # wakes the linger thread
        self._flusher: threading.Thread | None = None
        self._flusher_idle = False  # waiting untimed: a new batch must notify it
        self._closing = False
        self._refused: list[WireError] = []  # groups the service rejected, raised at the end of a settle
        self.counters = {
            "puts": 0.0,
            "duplicates": 0.0,
            "full": 0.0,
            "retries": 0.0,
            "blocked_s": 0.0,
            "batches": 0.0,
            "rejected": 0.0,
        }

    def put(self, group: Group, timeout: float | None = None) -> None:
        """Hand ``group`` over; blocks while the window is full of unacknowledged puts.

        TimeoutError: the service stayed full for ``timeout`` s; this group is not stored (earlier
        ones in flight still will be). ``put`` of the same Group object again is a retry, not a
        second copy. WireError: the service refused a group of an earlier batch (named there).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            if id(group) in self._held:
                self.counters["retries"] += 1
                self._stalled = True
            else:
                self._enqueue(group)
                if len(self._inflight) < self.window:  # else the settle below sends it at once
                    self._send_or_hold()
            try:
                if len(self._inflight) >= self.window:  # down to half: fewer, larger waits
                    self._settle(self.window // 2, deadline)
            except TimeoutError:
                self._drop_tail(group)
                self._stalled = True  # earlier puts refused with it go out again on the next put
                raise

    def flush(self, timeout: float | None = None) -> None:
        """Send the batch being filled and wait until every put so far is acknowledged (stored)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._settle(0, deadline)

    # ------------------------------------------------------------------------------ sending
    def _enqueue(self, group: Group) -> None:
        frame = encode_group(group)
        if len(frame) > self.max_frame_bytes:
            raise WireError(
                "oversized",
                f"group {group.prompt_id} encodes to {len(frame)} bytes > "
                f"{self.max_frame_bytes}; raise buffer.max_frame_mb",
            )
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        self._inflight[seq] = _Put(group, frame)
        self._held.add(id(group))
        if not self._pending:
            self._pending_since = time.monotonic()
        self._pending.append(seq)
        self._pending_bytes += len(frame)

    def _send_or_hold(self) -> None:
        """Send the batch if it is full (or nothing lingers), else let it wait for more groups."""
        if self._stalled:
            return  # the next settle resends everything in flight, the batch included
        if self.linger_s == 0 or len(self._pending) >= self.batch_groups or self._pending_bytes >= self.batch_bytes:
            self._send_pending()
        elif len(self._pending) == 1:
            self._arm_linger()

    def _send_pending(self) -> None:
        if self._pending:
            self._send_batch(self._pending)
            self._pending, self._pending_bytes = [], 0

    def _send_batch(self, seqs: list[int]) -> None:
        """One message: the header names the first seq, the groups follow as parts (consecutive seqs)."""
        puts = [self._inflight[s] for s in seqs]
        rid = self._rpc.send(
            {"op": "put", "producer": self.producer_id, "seq": seqs[0]}, payloads=[p.frame for p in puts]
        )
        for p in puts:
            p.rid = rid
        self.counters["batches"] += 1

    def _resend_from(self, first: int) -> None:
        """Go-back-N: every unacknowledged seq from ``first`` on, in batches, pending ones included.

        A batch holds consecutive seqs only (the service numbers its groups from the header's
        seq): a refused group leaves a hole in the window, and the batch is split there."""
        batch: list[int] = []
        size = 0
        for seq, put in self._inflight.items():
            if seq < first:
                continue
            if batch and (
                len(batch) >= self.batch_groups or size + len(put.frame) > self.batch_bytes or seq != batch[-1] + 1
            ):
                self._send_batch(batch)
                batch, size = [], 0
            batch.append(seq)
            size += len(put.frame)
        if batch:
            self._send_batch(batch)
        self._pending, self._pending_bytes = [], 0

    # ------------------------------------------------------------------------------ linger
    def _arm_linger(self) -> None:
        """A batch started filling: make sure the linger thread will send it on time."""
        if self._flusher is None:
            self._flusher = threading.Thread(target=self._linger_loop, name="buffer-producer-linger", daemon=True)
            self._flusher.start()
        elif self._flusher_idle:
            self._cond.notify()

    def _linger_loop(self) -> None:
        """Send a batch whose oldest group has waited ``linger_ms``. It sleeps untimed while no
        batch is filling and wakes by its own deadline otherwise, so a busy producer (whose batches
        fill before the linger ends) notifies it only when a batch starts after an idle spell."""
        with self._cond:
            while not self._closing:
                if not self._pending or self._stalled:
                    self._flusher_idle = True
                    self._cond.wait()
                    self._flusher_idle = False
                    continue
                left = self._pending_since + self.linger_s - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                try:
                    self._send_pending()
                except Exception:  # the next put or flush resends; never die silently here
                    log.exception("buffer producer: sending a lingering batch failed")
                    self._stalled = True

    # ------------------------------------------------------------------------------ answers
    def _settle(self, most: int, deadline: float | None) -> None:
        """Handle replies until at most ``most`` puts are unacknowledged (a held batch goes first)."""
        if self._stalled and self._inflight:
            self._resend_from(next(iter(self._inflight)))
        else:
            self._send_pending()
        self._stalled = False
        while len(self._inflight) > most:
            reply = self._rpc.recv(self.rpc_timeout_s, limit=1 << 16)
            if reply is None:
                self._stalled = True
                raise BufferUnavailable(
                    f"no answer from the buffer service at {self._rpc.address} in "
                    f"{self.rpc_timeout_s}s; {len(self._inflight)} puts unacknowledged "
                    "(the next put or flush resends them)"
                )
            self._on_reply(reply, deadline)
            while len(self._inflight) > most and (reply := self._rpc.recv_nowait(limit=1 << 16)) is not None:
                self._on_reply(reply, deadline)
        if self._refused:
            error, self._refused = self._refused[0], []
            raise error

    def _on_reply(self, reply: dict, deadline: float | None) -> None:
        for rid, seq, status in _statuses(reply):
            self._on_status(rid, seq, status, deadline)

    def _on_status(self, rid: int, seq: int, status: str, deadline: float | None) -> None:
        put = self._inflight.get(seq)
        final = _final(status)
        if put is None or (rid != put.rid and not final):
            return  # a refusal of a send we have since repeated (a decision is final, whichever send)
        if final:
            self._done(seq, status)
        elif status == "closed":
            self._closed()
        elif status == "full":
            self.counters["full"] += 1
            self._blocked_at = self._blocked_at if self._blocked_at is not None else time.monotonic()
            self._wait_space(deadline)
            self._resend_from(seq)
        elif status == "gap":  # an earlier send never arrived: resend everything in flight
            self._resend_from(next(iter(self._inflight)))
        else:
            raise WireError("bad_schema", f"unexpected put status {status!r}")

    def _done(self, seq: int, status: str) -> None:
        """The service decided ``seq``: it leaves the window (a rejection is raised once the
        settle ends, so the other groups' answers in the burst are not lost)."""
        put = self._inflight.pop(seq)
        self._held.discard(id(put.group))
        if status.startswith("rejected_"):
            reason = status[len("rejected_") :]
            self.counters["rejected"] += 1
            self._refused.append(
                WireError(
                    reason if reason in REASONS else "malformed",
                    f"the service refused group {put.group.prompt_id} (seq {seq})",
                )
            )
            return
        self.counters["puts"] += 1
        self.counters["duplicates"] += status == "duplicate"
        if self._blocked_at is not None:
            self.counters["blocked_s"] += time.monotonic() - self._blocked_at
            self._blocked_at = None

    def _wait_space(self, deadline: float | None) -> None:
        """Park on the service until it has room (replies to other sends meanwhile are stale)."""
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise TimeoutError("SampleBuffer service full for the whole put timeout")
        wait_ms = self.wait_ms if left is None else max(1, min(self.wait_ms, int(left * 1000)))
        rid = self._rpc.send({"op": "wait_space", "wait_ms": wait_ms})
        give_up = time.monotonic() + wait_ms / 1000 + self.rpc_timeout_s
        while (reply := self._rpc.recv(give_up - time.monotonic(), limit=1 << 16)) is not None:
            if reply.get("rid") == rid:
                break
            self._apply_decisions(reply)
        if reply is None:
            self._stalled = True
            raise BufferUnavailable(f"no answer from the buffer service at {self._rpc.address}")
        if reply.get("status") == "closed":
            self._closed()

    def _apply_decisions(self, reply: dict) -> None:
        """While parked: take the stored/duplicate/rejected answers of other sends that arrive (a
        decision is final); refusals among them are moot, everything from the full one is resent."""
        for _, seq, status in _statuses(reply):
            if seq in self._inflight and _final(status):
                self._done(seq, status)

    def _closed(self) -> None:
        """The service was closed: nothing in flight will be stored."""
        self._inflight.clear()
        self._held.clear()
        raise BufferClosed("put on a closed SampleBuffer (service)")

    def _drop_tail(self, group: Group) -> None:
        """After a timeout: the newest put (this group) was refused, so forget it and reuse its seq."""
        if self._inflight:
            seq = next(reversed(self._inflight))
            if self._inflight[seq].group is group:
                del self._inflight[seq]
                self._held.discard(id(group))
                self._next_seq = seq
        self._blocked_at = None

    # ------------------------------------------------------------------------------ the rest
    def wake(self) -> None:
        """SampleBuffer API: nothing to wake on the producer side."""

    def stats(self) -> dict[str, float]:
        return dict(self.counters) | {"unacknowledged": float(len(self._inflight))}

    def close(self) -> None:
        """Flush what is in flight (the held batch too), stop the linger thread, release the socket."""
        try:
            if self._inflight:
                self.flush(timeout=self.rpc_timeout_s)
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify()
            if self._flusher is not None:
                self._flusher.join(5.0)
            self._rpc.close()


def _statuses(reply: dict):
    """``(rid, seq, status)`` per group of a burst's answers (``acks`` = [[rid, first seq, [status
    per group]], ...], in order); nothing for another reply (a wait_space we gave up on)."""
    if reply.get("status") != "acks":
        return
    for rid, first, statuses in reply["acks"]:
        for i, status in enumerate(statuses):
            yield rid, first + i, status


def _final(status: str) -> bool:
    """The service decided the seq (stored, a duplicate, or refused by name): it leaves the window."""
    return status in DONE or status.startswith("rejected_")
