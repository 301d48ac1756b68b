"""The buffer service's connections, bounded: a cap in all and per host, the idle closed.

libzmq gives a ROUTER no cap on its connections and no call to drop one: each accepted TCP
connection holds a file descriptor until its peer leaves, so ~1,000 connections that never send
a byte exhaust a process at the common open-files limit of 1,024, libzmq can accept no more
(``accept_failed``), and a real producer gets no answer. ``Connections`` keeps, per accepted
connection, its peer's host and when it was last active (accepted, or its last request), from
two sources libzmq does give: a socket monitor (each accepted connection's descriptor, each
disconnection) and each message's ``ZMQ_SRCFD`` (the descriptor it came on). It closes:

- past a cap (``per_host`` from one host, ``total`` in all), one of that host's or of all: the
  longest open of those that never sent a request, else the least recently active (not one
  whose request is parked, waiting on the service), counted ``connections_closed_cap``: a flood
  of connections that say nothing gives way to a producer that talks, which stays served while
  the cap is hit, and a producer arriving meanwhile has as many arrivals as the cap to say hello
  (a flood reconnecting at R connections a second leaves it cap / R seconds);
- a connection with no request for ``idle_s``, counted ``connections_closed_idle``;
- with libzmq (``ZMQ_HANDSHAKE_IVL`` = ``handshake_s``, set by the service), a connection that has
  not finished its ZMTP handshake in time, a raw TCP socket that sends nothing
  (``connections_closed_handshake``), and at once one that speaks no ZMTP or holds the wrong keys
  (``handshake_failed``).

A connection is closed by ``shutdown`` on its descriptor (borrowed, never duplicated: there may
be none left to duplicate), after checking the descriptor is still that connection (its peer and
local port): libzmq sees the peer gone and closes it itself. An honest client loses nothing it would not lose to a network blip: libzmq
reconnects a DEALER within 100 ms, and its requests are retried (puts are idempotent, takes
replayed).

The caps must fit the process's descriptors: ``fit_caps`` raises the soft ``RLIMIT_NOFILE`` toward
the hard one as far as the caps need, and lowers a cap the limit cannot hold to half the
descriptors left (the other half: connections accepted and not yet closed, and the process's own
files), with a warning naming the fix. Not used: ``ZMQ_MAX_SOCKETS`` bounds a context's zmq
sockets, not a ROUTER's connections; heartbeats (``ZMQ_HEARTBEAT_IVL``/``TIMEOUT``/``TTL``) are
answered by the peer's libzmq I/O thread, so they show a peer's process alive, never that it uses
its connection (an idle DEALER answers them for ever); ``idle_s`` also closes a dead peer's.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import socket
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

EVENTS = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_ACCEPT_FAILED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
REFUSED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH  # not ZMTP, wrong keys
COUNTERS = (
    "connections_closed_cap",
    "connections_closed_idle",
    "connections_closed_handshake",
    "handshake_failed",
    "accept_failed",
)
MIN_CAP = 8


@dataclass(frozen=True)
class ConnectionLimits:
    total: int = 1024  # connections in all
    per_host: int = 256  # connections from one peer address
    idle_s: float = 600.0  # a connection with no request for this long is closed (> MAX_WAIT_MS)
    handshake_s: float = 10.0  # one that has not finished its ZMTP handshake by then is closed (libzmq)


@dataclass
class _Conn:
    host: str  # the peer's address without its port ("" for ipc://)
    peer: Any  # getpeername() when accepted: checked again before the descriptor is shut down
    last: float  # when it was accepted or last sent a request
    identity: bytes = b""  # its routing id, once it has sent a request


class Connections:
    def __init__(self, total: int, per_host: int, idle_s: float, count: Callable[[str], None]):
        self.total, self.per_host, self.idle_s, self._count = total, per_host, idle_s, count
        self._conns: OrderedDict[int, _Conn] = OrderedDict()  # descriptor -> connection, least recently active first
        self._hosts: Counter[str] = Counter()  # host -> its connections
        self._port: Any = None  # the listener's local port (tcp) or path (ipc)
        self.monitor: zmq.Socket | None = None

    def watch(self, ctx: zmq.Context, sock: zmq.Socket) -> zmq.Socket:
        """Monitor ``sock`` (before it binds); the socket to poll for its events."""
        addr = f"inproc://buffer-connections-{id(self)}"
        sock.monitor(addr, EVENTS)
        self.monitor = ctx.socket(zmq.PAIR)
        self.monitor.setsockopt(zmq.RCVHWM, 0)  # no event dropped while the service is busy
        self.monitor.setsockopt(zmq.LINGER, 0)
        self.monitor.connect(addr)
        return self.monitor

    def listening(self, endpoint: str) -> None:
        """The listener's endpoint, once bound: a descriptor is shut down only if it is still ours."""
        tail = endpoint.split("://", 1)[1]
        self._port = tail if endpoint.startswith("ipc://") else int(tail.rsplit(":", 1)[1])

    def __len__(self) -> int:
        return len(self._conns)

    # ------------------------------------------------------------------------------ events
    def on_events(self, busy: set[bytes], now: float | None = None) -> None:
        """Every monitor event waiting; a connection accepted past a cap closes another (``_evict``)."""
        assert self.monitor is not None
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            kind, fd = event["event"], event["value"]
            if kind == zmq.EVENT_ACCEPTED:
                self._accepted(fd, busy, time.monotonic() if now is None else now)
            elif kind == zmq.EVENT_DISCONNECTED:
                self._drop(fd)
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and fd == errno.EAGAIN:  # its value: an errno
                self._count("connections_closed_handshake")  # libzmq's handshake timer (handshake_s)
            elif kind & REFUSED:
                self._count("handshake_failed")
            elif kind == zmq.EVENT_ACCEPT_FAILED:
                self._count("accept_failed")

    def _accepted(self, fd: int, busy: set[bytes], now: float) -> None:
        with _borrowed(fd) as sock:
            names = _names(sock)
        if names is None:  # gone already
            return
        self._drop(fd)  # a disconnection not seen: the descriptor is another connection now
        conn = self._conns[fd] = _Conn(host=_host(names[1]), peer=names[1], last=now)
        self._hosts[conn.host] += 1
        while self._hosts[conn.host] > self.per_host and self._evict(busy, conn.host):
            pass
        while len(self._conns) > self.total and self._evict(busy, None):
            pass

    def _drop(self, fd: int) -> _Conn | None:
        conn = self._conns.pop(fd, None)
        if conn is not None:
            self._hosts[conn.host] -= 1
            if not self._hosts[conn.host]:
                del self._hosts[conn.host]
        return conn

    def touch(self, frame: zmq.Frame, identity: bytes, now: float | None = None) -> None:
        """A request came on ``frame``'s connection: it is the most recently active."""
        try:
            fd = frame.get(zmq.SRCFD)
        except zmq.ZMQError:  # a libzmq without SRCFD: connections age from when they were accepted
            return
        conn = self._conns.get(fd)
        if conn is not None:
            conn.last, conn.identity = time.monotonic() if now is None else now, identity
            self._conns.move_to_end(fd)

    def sweep(self, busy: set[bytes], now: float | None = None) -> None:
        """Close every connection with no request for ``idle_s`` (one waiting on a parked request
        is not idle)."""
        now = time.monotonic() if now is None else now
        for fd, conn in list(self._conns.items()):
            if now - conn.last < self.idle_s:
                return  # the rest are more recent
            if not _busy(conn, busy):
                self._close(fd, "connections_closed_idle")

    # ------------------------------------------------------------------------------ closing
    def _evict(self, busy: set[bytes], host: str | None) -> bool:
        """Close one connection (of ``host``, if given): the longest open of those that never sent
        a request, else the least recently active of the rest that is not busy."""
        mine = [(fd, c) for fd, c in self._conns.items() if host is None or c.host == host]
        for fd, conn in [(fd, c) for fd, c in mine if not c.identity] or mine:
            if not _busy(conn, busy):
                self._close(fd, "connections_closed_cap")
                return True
        return False

    def _close(self, fd: int, counter: str) -> None:
        conn = self._drop(fd)
        with _borrowed(fd) as sock:
            names = _names(sock)
            if sock is None or conn is None or names is None or names[1] != conn.peer or _local(names[0]) != self._port:
                return  # closed meanwhile, maybe reused: not ours to shut down
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                return
        self._count(counter)

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close(0)
            self.monitor = None


def _busy(conn: _Conn, busy: set[bytes]) -> bool:
    return bool(conn.identity) and conn.identity in busy


@contextlib.contextmanager
def _borrowed(fd: int) -> Iterator[socket.socket | None]:
    """Descriptor ``fd`` as a socket object that never closes it (it is libzmq's); None if it is
    closed or not a socket. No descriptor is duplicated: the service must be able to close
    connections when every descriptor is taken."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        yield None
        return
    try:
        yield sock
    finally:
        sock.detach()


def _names(sock: socket.socket | None) -> tuple[Any, Any] | None:
    """(local, peer) names of ``sock``; None if it has none (closed, not connected)."""
    if sock is None:
        return None
    try:
        return sock.getsockname(), sock.getpeername()
    except OSError:
        return None


def _host(peer: Any) -> str:
    return peer[0] if isinstance(peer, tuple) else ""


def _local(name: Any) -> Any:
    return name[1] if isinstance(name, tuple) else (name.decode() if isinstance(name, bytes) else name)


def fit_caps(total: int, per_host: int) -> tuple[int, int]:
    """(total, per_host) as this process's open-files limit can hold them (see the module
    docstring): the soft limit raised toward the hard one first."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    used = _open_descriptors()
    need = used + 2 * total
    if soft != resource.RLIM_INFINITY and soft < need:
        raised = need if hard == resource.RLIM_INFINITY else min(hard, need)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    room = total if soft == resource.RLIM_INFINITY else (soft - used) // 2
    if room < total:
        log.warning(
            "buffer service: %d open files allowed and %d in use: at most %d connections, not %d "
            "(raise the open-files limit, ulimit -n, to serve more)",
            soft,
            used,
            max(room, MIN_CAP),
            total,
        )
        total = max(room, MIN_CAP)
    return total, min(per_host, total)


def _open_descriptors() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc: assume a busy process
        return 256
