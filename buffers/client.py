"""Clients of the BufferService: ``BufferProducer`` (put) and ``RemoteSampleBuffer`` (the full API).

``RemoteSampleBuffer`` keeps ``SampleBuffer``'s API so the controller takes either. Its
``get_batch(n, select)`` cannot ship ``select`` (a callable) to the service, so it long-polls the
service's metadata (``GroupMeta``: key, version, prompt id, size), runs ``select`` on it here, and
takes exactly the chosen keys; if another consumer got one first, the take is refused as a whole
and it looks again. ``select`` sees metadata, not samples: a rule may read ``version``,
``prompt_id``, ``admitted_version``, ``data_index``, ``num_samples`` and ``nbytes``.

``wake()`` is a byte on a pipe the waiting ``get_batch`` polls beside its socket, so scheduler
threads may call it at any time and the rule is re-evaluated at once.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import uuid
from typing import Any

import zmq

from buffers.buffer import BufferClosed, Select, _oldest
from buffers.store import GroupMeta
from buffers.types import Group
from buffers.wire import WireError, decode_group, encode_group, pack, unpack


class BufferUnavailable(ConnectionError):
    """The service did not answer in time; the request may be retried (puts are idempotent)."""


class _Rpc:
    """One DEALER socket; replies are matched to requests by ``rid`` and stale ones dropped.

    ``wait`` also returns early (None) when ``wake_fd`` becomes readable.
    """

    def __init__(self, address: str, max_frame_bytes: int, wake_fd: int | None = None):
        self.address, self.max_frame_bytes, self.wake_fd = address, max_frame_bytes, wake_fd
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self._rids = itertools.count()
        self._poller, self._wake_poller = zmq.Poller(), zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._wake_poller.register(self.sock, zmq.POLLIN)
        if wake_fd is not None:
            self._wake_poller.register(wake_fd, zmq.POLLIN)

    def send(self, message: dict) -> int:
        rid = next(self._rids)
        self.sock.send(pack({**message, "rid": rid}), copy=False)
        return rid

    def wait(self, rid: int, timeout_s: float, limit: int | None = None, wakeable: bool = False) -> dict | None:
        """The reply to ``rid``; None on timeout (or on a wake, if ``wakeable``).

        A rejection raises its WireError: the service refused what this client sent (a bug here).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            poller = self._wake_poller if wakeable else self._poller
            events = dict(poller.poll(max(1, int(left * 1000))))
            if wakeable and self.wake_fd in events:
                return None
            if self.sock not in events:
                continue
            reply = unpack(self.sock.recv(copy=False).buffer, limit or self.max_frame_bytes)
            if not isinstance(reply, dict) or reply.get("rid") != rid:
                continue  # the late answer to a request we stopped waiting for
            if reply.get("status") == "rejected":
                raise WireError(reply.get("reason", "malformed"), f"service refused: {reply.get('detail')}")
            return reply

    def call(self, message: dict, timeout_s: float, limit: int | None = None) -> dict:
        rid = self.send(message)
        reply = self.wait(rid, timeout_s, limit)
        if reply is None:
            raise BufferUnavailable(f"no answer from the buffer service at {self.address} in {timeout_s}s")
        return reply

    def close(self) -> None:
        self.sock.close(0)
        self._ctx.term()


class BufferProducer:
    """Puts groups into a BufferService: acknowledged, idempotent, blocking while it is full."""

    def __init__(self, address: str, max_frame_mb: float = 64.0, rpc_timeout_s: float = 10.0,
                 wait_ms: int = 500):
        self.max_frame_bytes = int(max_frame_mb * (1 << 20))
        self.rpc_timeout_s, self.wait_ms = rpc_timeout_s, wait_ms
        self._rpc = _Rpc(address, self.max_frame_bytes)
        self.producer_id = uuid.uuid4().hex
        self._seqs = itertools.count()
        self._pending: tuple[Group, int, bytes] | None = None  # handed to us, not yet acknowledged
        self._lock = threading.Lock()
        self.counters = {"puts": 0.0, "duplicates": 0.0, "full": 0.0, "retries": 0.0, "blocked_s": 0.0}

    def put(self, group: Group, timeout: float | None = None) -> None:
        """Store ``group`` exactly once. Blocks while the service is full (backpressure).

        TimeoutError: still full after ``timeout`` s (not stored). BufferUnavailable: no answer;
        ``put`` the same Group object again to retry -- it keeps its put id, so it cannot be
        stored twice. A different group first settles the pending one (nothing is dropped).
        """
        with self._lock:
            if self._pending is not None and self._pending[0] is not group:
                self._deliver(*self._pending[1:], deadline=None)
            if self._pending is not None:
                self.counters["retries"] += 1  # the same group again after BufferUnavailable
            else:
                frame = encode_group(group)
                if len(frame) > self.max_frame_bytes:
                    raise WireError("oversized", f"group {group.prompt_id} encodes to {len(frame)} bytes > "
                                                 f"{self.max_frame_bytes}; raise buffer.max_frame_mb")
                self._pending = (group, next(self._seqs), frame)
            deadline = None if timeout is None else time.monotonic() + timeout
            self._deliver(*self._pending[1:], deadline=deadline)

    def _deliver(self, seq: int, frame: bytes, deadline: float | None) -> None:
        message = {"op": "put", "producer": self.producer_id, "seq": seq, "group": frame}
        blocked_at: float | None = None
        while True:
            reply = self._rpc.call(message, self.rpc_timeout_s, limit=1 << 16)
            status = reply.get("status")
            if status in ("stored", "duplicate"):
                self._pending = None
                self.counters["puts"] += 1
                self.counters["duplicates"] += status == "duplicate"
                if blocked_at is not None:
                    self.counters["blocked_s"] += time.monotonic() - blocked_at
                return
            if status == "closed":
                self._pending = None
                raise BufferClosed("put on a closed SampleBuffer (service)")
            if status != "full":
                raise WireError("bad_schema", f"unexpected put reply {reply!r}")
            self.counters["full"] += 1
            blocked_at = blocked_at if blocked_at is not None else time.monotonic()
            self._wait_space(deadline)

    def _wait_space(self, deadline: float | None) -> None:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            self._pending = None  # the service said full: it does not hold the group
            raise TimeoutError("SampleBuffer service full for the whole put timeout")
        wait_ms = self.wait_ms if left is None else max(1, min(self.wait_ms, int(left * 1000)))
        self._rpc.call({"op": "wait_space", "wait_ms": wait_ms}, wait_ms / 1000 + self.rpc_timeout_s)

    def wake(self) -> None:
        """SampleBuffer API: nothing to wake on the producer side."""

    def stats(self) -> dict[str, float]:
        return dict(self.counters)

    def close(self) -> None:
        self._rpc.close()


class RemoteSampleBuffer:
    """SampleBuffer's API over a BufferService (see the module docstring for ``select``)."""

    def __init__(self, address: str, max_frame_mb: float = 64.0, rpc_timeout_s: float = 10.0,
                 poll_ms: int = 1000):
        self.address, self.max_frame_mb = address, max_frame_mb
        self.max_frame_bytes = int(max_frame_mb * (1 << 20))
        self.rpc_timeout_s, self.poll_ms = rpc_timeout_s, poll_ms
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._data = _Rpc(address, self.max_frame_bytes, wake_fd=self._wake_r)
        self._ctl = _Rpc(address, self.max_frame_bytes)
        self._get_lock, self._ctl_lock = threading.Lock(), threading.Lock()
        self._producer: BufferProducer | None = None
        self._producer_lock = threading.Lock()

    def put(self, group: Group, timeout: float | None = None) -> None:
        with self._producer_lock:
            if self._producer is None:
                self._producer = BufferProducer(self.address, self.max_frame_mb, self.rpc_timeout_s)
        self._producer.put(group, timeout)

    def get_batch(self, n: int, select: Select | None = None, timeout: float | None = None) -> list[Group]:
        """Remove and return a batch: ``select(metas)`` picks indices, or None to keep waiting."""
        select = select or (lambda groups: _oldest(groups, n))
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._get_lock:
            self._drain_wakes()
            view: dict | None = None
            while True:
                view = self._next_view(view, deadline)
                if view is None:
                    raise TimeoutError(f"no batch of {n} groups within {timeout}s")
                if view["closed"]:
                    raise BufferClosed("get_batch on a closed SampleBuffer (service)")
                metas = view["metas"]
                picked = select(list(metas))
                if picked is None:
                    continue
                batch = self._take([metas[i].key for i in sorted(set(picked))])
                if batch is not None:
                    return batch

    def _next_view(self, view: dict | None, deadline: float | None) -> dict | None:
        """The service's metadata once it changes (or at once the first time, or on ``wake``)."""
        since = -1 if view is None else view["epoch"]
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            wait_ms = self.poll_ms if left is None else max(0, min(self.poll_ms, int(left * 1000)))
            rid = self._data.send({"op": "meta", "since": since, "wait_ms": wait_ms})
            reply = self._data.wait(rid, wait_ms / 1000 + self.rpc_timeout_s, wakeable=True)
            if reply is None and self._drain_wakes() and view is not None:
                return view  # woken: re-run select on what we last saw
            if reply is None:
                continue
            fresh = _parse_meta(reply)
            if fresh["epoch"] != since or fresh["closed"]:
                return fresh

    def _take(self, keys: list[int]) -> list[Group] | None:
        limit = self.max_frame_bytes * (len(keys) + 1)
        reply = self._data.call({"op": "take", "keys": keys}, self.rpc_timeout_s, limit=limit)
        if reply.get("status") == "closed":
            raise BufferClosed("get_batch on a closed SampleBuffer (service)")
        if reply.get("status") != "ok":
            return None  # another consumer took one of them first: look again
        return [decode_group(unpack(f, self.max_frame_bytes)) for f in reply["groups"]]

    def _drain_wakes(self) -> bool:
        try:
            return bool(os.read(self._wake_r, 4096))
        except BlockingIOError:
            return False

    def wake(self) -> None:
        """Re-evaluate a waiting ``get_batch`` rule now (its inputs changed outside the buffer)."""
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # a wake is already pending

    def drain(self) -> list[Group]:
        reply = self._control({"op": "drain"}, limit=1 << 40)
        return [decode_group(unpack(f, self.max_frame_bytes)) for f in reply["groups"]]

    def close(self) -> None:
        """Close the service's buffer: every waiting producer and consumer gets BufferClosed."""
        self._control({"op": "close"})

    def disconnect(self) -> None:
        """Release this proxy's sockets (the service and its buffer go on)."""
        for rpc in (self._data, self._ctl):
            rpc.close()
        if self._producer is not None:
            self._producer.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __len__(self) -> int:
        return len(_parse_meta(self._control({"op": "meta", "since": -1, "wait_ms": 0}))["metas"])

    def stats(self) -> dict[str, float]:
        return {k: float(v) for k, v in self._control({"op": "stats"})["stats"].items()}

    def _control(self, message: dict, limit: int | None = None) -> dict:
        with self._ctl_lock:
            return self._ctl.call(message, self.rpc_timeout_s, limit=limit)


def _parse_meta(reply: dict) -> dict[str, Any]:
    """A meta reply → {epoch, closed, capacity, metas}; a malformed one is a WireError."""
    try:
        if any(not isinstance(row, list) or len(row) != 7 for row in reply["groups"]):
            raise TypeError("rows of 7 ints expected")
        metas = [GroupMeta(*row) for row in reply["groups"]]
        return {"epoch": int(reply["epoch"]), "closed": bool(reply["closed"]),
                "capacity": int(reply["capacity"]), "metas": metas}
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError("bad_schema", f"malformed meta reply: {exc}") from None
