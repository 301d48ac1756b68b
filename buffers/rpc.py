"""The client end of the buffer service: one DEALER socket, request ids, replies matched by id."""

from __future__ import annotations

import itertools
import time

import zmq

from .auth import ClientKeys
from .wire import WireError, pack, unpack


class BufferUnavailable(ConnectionError):
    """The service did not answer in time; the request may be retried (puts are idempotent)."""


class BufferServiceError(RuntimeError):
    """The service failed on a request (a bug there, counted as ``internal_errors``; it keeps serving)."""


SEND_TIMEOUT_MS = 30_000  # a send with no pipe to queue on (the service dropped us) gives up after this


class Rpc:
    """One DEALER socket; replies are matched to requests by ``rid`` and stale ones dropped.

    ``wait`` also returns early (None) when ``wake_fd`` becomes readable. A send that cannot be
    queued (the service dropped this client and the socket has no pipe left) raises
    ``BufferUnavailable`` after ``SEND_TIMEOUT_MS`` instead of blocking for ever: the callers
    already retry on it (puts are idempotent, takes replayed).
    """

    def __init__(self, address: str, max_frame_bytes: int, wake_fd: int | None = None, keys: ClientKeys | None = None):
        self.address, self.max_frame_bytes, self.wake_fd = address, max_frame_bytes, wake_fd
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        if keys is not None:
            keys.apply(self.sock)
        self.sock.connect(address)
        self._rids = itertools.count()
        self._poller, self._wake_poller = zmq.Poller(), zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._wake_poller.register(self.sock, zmq.POLLIN)
        if wake_fd is not None:
            self._wake_poller.register(wake_fd, zmq.POLLIN)

    def send(self, message: dict, payloads: list[bytes] | tuple = ()) -> int:
        """Send ``message`` and each of ``payloads`` as a further part of one message; its ``rid``.

        A large payload goes uncopied (zero-copy only pays above ~64 KiB: below, the bookkeeping
        of a borrowed buffer costs more than the copy).
        """
        rid = next(self._rids)
        header = pack({**message, "rid": rid})
        try:  # only a message's first part can block: once it is queued its other parts follow it
            self.sock.send(header, zmq.SNDMORE if payloads else 0)
        except zmq.Again:
            raise BufferUnavailable(
                f"the buffer service at {self.address} takes no messages from this client "
                f"(dropped, or never connected) after {SEND_TIMEOUT_MS / 1000:.0f}s"
            ) from None
        last = len(payloads) - 1
        for i, part in enumerate(payloads):
            self.sock.send(part, zmq.SNDMORE if i < last else 0, copy=len(part) < (1 << 16))
        return rid

    def wait(self, rid: int, timeout_s: float, limit: int | None = None, wakeable: bool = False) -> dict | None:
        """The reply to ``rid``; None on timeout (or on a wake, if ``wakeable``). Others are dropped:
        they answer requests this client stopped waiting for."""
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self.recv(deadline - time.monotonic(), limit, wakeable)
            if reply is None or reply.get("rid") == rid:
                return reply

    def recv(self, timeout_s: float, limit: int | None = None, wakeable: bool = False) -> dict | None:
        """The next reply, whatever it answers; None on timeout (or on a wake, if ``wakeable``).

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
            return self._parse(self.sock.recv(copy=False), limit)

    def recv_nowait(self, limit: int | None = None) -> dict | None:
        """A reply already here, else None (draining a burst costs no wake-ups)."""
        try:
            return self._parse(self.sock.recv(zmq.NOBLOCK, copy=False), limit)
        except zmq.Again:
            return None

    def _parse(self, frame: zmq.Frame, limit: int | None) -> dict:
        reply = unpack(frame.buffer, limit or self.max_frame_bytes)
        if not isinstance(reply, dict):
            raise WireError("bad_schema", f"a reply is a map, got {type(reply).__name__}")
        if reply.get("status") == "rejected":
            raise WireError(reply.get("reason", "malformed"), f"service refused: {reply.get('detail')}")
        if reply.get("status") == "error":
            raise BufferServiceError(f"buffer service at {self.address}: {reply.get('detail')}")
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
