"""Connections the gateway does not keep: a request head must arrive within a timeout.

A client that opens a connection and then sends nothing, or a request head a few bytes at a time
(slowloris), would hold a socket and a file descriptor of the gateway for ever. ``ConnectionGuard``
puts every accepted connection's protocol (aiohttp's request handler) behind a small wrapper and
gives each connection a deadline while it waits for a request head: from when it opens, and again
from when the gateway answers a request on it (keep-alive). The head arriving (the gateway's
middleware calling ``busy``) lifts the deadline; past it, the connection is closed. A body read
has its own timeout (the gateway's ``_body``). The wrapper works on any aiohttp version: it needs
nothing of the handler but the asyncio protocol methods it forwards.

Closes are counted: ``header_timeout`` (a connection that never sent a request, or stopped
partway through a head) and ``idle_closed`` (a kept-alive connection idle after its last answer).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Conn:
    served: int = 0  # requests answered on this connection
    partial: bool = False  # bytes came while waiting for a head
    timer: asyncio.TimerHandle | None = None


class ConnectionGuard:
    """Header-timeout watch over the connections of one server (all calls on its event loop)."""

    def __init__(self, header_timeout_s: float, count: Callable[[str], None]):
        if not header_timeout_s > 0:
            raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")
        self.header_timeout_s, self._count = header_timeout_s, count
        self._conns: dict[asyncio.BaseTransport, _Conn] = {}

    def protocol(self, factory: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for ``loop.create_server``: ``factory``'s protocols, watched."""
        return lambda: _Watched(factory(), self)

    def open_connections(self) -> int:
        return len(self._conns)

    def busy(self, transport: asyncio.BaseTransport | None) -> None:
        """A request head arrived on ``transport``: no deadline while it is served."""
        conn = self._conns.get(transport)
        if conn is not None and conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None

    def idle(self, transport: asyncio.BaseTransport | None) -> None:
        """The request on ``transport`` was answered: the next head has ``header_timeout_s``."""
        conn = self._conns.get(transport)
        if conn is not None and not transport.is_closing():
            conn.served += 1
            self._wait(transport, conn)

    def _wait(self, transport: asyncio.BaseTransport, conn: _Conn) -> None:
        if conn.timer is not None:
            conn.timer.cancel()
        conn.partial = False
        conn.timer = asyncio.get_running_loop().call_later(self.header_timeout_s, self._expire, transport)

    def _opened(self, transport: asyncio.BaseTransport) -> None:
        conn = self._conns[transport] = _Conn()
        self._wait(transport, conn)

    def _data(self, transport: asyncio.BaseTransport) -> None:
        conn = self._conns.get(transport)
        if conn is not None and conn.timer is not None:
            conn.partial = True

    def _closed(self, transport: asyncio.BaseTransport) -> None:
        conn = self._conns.pop(transport, None)
        if conn is not None and conn.timer is not None:
            conn.timer.cancel()

    def _expire(self, transport: asyncio.BaseTransport) -> None:
        conn = self._conns.get(transport)
        if conn is None:
            return
        conn.timer = None
        self._count("idle_closed" if conn.served and not conn.partial else "refused/header_timeout")
        transport.close()


class _Watched(asyncio.Protocol):
    """A connection's protocol with the guard told when it opens, receives and closes."""

    def __init__(self, inner: asyncio.Protocol, guard: ConnectionGuard):
        self.inner, self.guard, self.transport = inner, guard, None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.guard._opened(transport)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.guard._data(self.transport)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard._closed(self.transport)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()
