"""The buffer service's connections are bounded: a cap in all and per host, where the least
recently active connection gives way, the idle and the never-handshaken closed, each counted; a
producer that talks stays served while a flood of silent connections holds the cap."""

from __future__ import annotations

import logging
import socket
import time

import pytest
import zmq

from flash.buffers import connections
from flash.buffers.connections import ConnectionLimits, fit_caps
from flash.buffers.producer import BufferProducer
from flash.buffers.service import BufferService
from tests.helpers.wire import _raw_socket, hello, make_group


def _service(**limits) -> BufferService:
    return BufferService(capacity=256, connections=ConnectionLimits(**limits)).start()


def _flood(svc: BufferService, n: int, source: str = "127.0.0.1") -> list[socket.socket]:
    """``n`` raw TCP connections to ``svc`` that never send a byte."""
    host, port = svc.address[len("tcp://") :].rsplit(":", 1)
    return [socket.create_connection((host, int(port)), source_address=(source, 0)) for _ in range(n)]


def _closed(socks: list[socket.socket]) -> list[bool]:
    """Which of ``socks`` the service has closed (read to their end: the ZMTP greeting, then EOF)."""
    out = []
    for s in socks:
        s.setblocking(False)
        try:
            while s.recv(4096):
                pass
            out.append(True)
        except BlockingIOError:
            out.append(False)
        except ConnectionResetError:
            out.append(True)
    return out


def _until(svc: BufferService, key: str, value: float, timeout_s: float = 5.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while (stats := svc.stats())[key] < value and time.monotonic() < deadline:
        time.sleep(0.01)
    return stats


def _puts(producer: BufferProducer, svc: BufferService, pids: range) -> None:
    for pid in pids:
        producer.put(make_group(pid))
    producer.flush()
    assert set(pids) <= {m.prompt_id for m in svc.buffer.meta()[2]}


def test_past_the_cap_silent_connections_give_way_and_a_talking_producer_stays_served():
    svc = _service(total=16, per_host=16)
    producer = BufferProducer(svc.address, rpc_timeout_s=5.0)
    try:
        _puts(producer, svc, range(0, 4))
        flood = _flood(svc, 100)
        stats = _until(svc, "connections_closed_cap", 101 - 16)
        _puts(producer, svc, range(4, 8))  # on the same connection: it talked, so it was never the oldest
        more = _flood(svc, 30)
        _puts(producer, svc, range(8, 12))
        stats = _until(svc, "connections_closed_cap", 131 - 16)
        assert stats["connections_closed_cap"] == 131 - 16 and stats["connections"] == 16
        closed = _closed(flood + more)
        assert sum(closed) == 115 and not any(closed[-15:])  # the 15 most recent silent ones stay
        late = BufferProducer(svc.address, rpc_timeout_s=5.0)  # a producer arriving while the cap is hit
        _puts(late, svc, range(12, 14))
        late.close()
        assert svc.stats()["connections_closed_cap"] == 116 and svc.stats()["handshake_failed"] == 0
        for s in flood + more:
            s.close()
    finally:
        producer.close()
        svc.stop()


def test_one_host_is_capped_and_another_hosts_producer_is_served():
    svc = _service(total=64, per_host=8)
    try:
        flood = _flood(svc, 40, source="127.0.0.2")  # another peer address on the loopback
        stats = _until(svc, "connections_closed_cap", 32)
        producer = BufferProducer(svc.address, rpc_timeout_s=5.0)  # from 127.0.0.1
        _puts(producer, svc, range(3))
        stats = svc.stats()
        assert stats["connections_closed_cap"] == 32 and stats["connections"] == 9
        assert sum(_closed(flood)) == 32
        producer.close()
        for s in flood:
            s.close()
    finally:
        svc.stop()


def test_idle_connections_are_closed_and_one_that_talks_is_not():
    svc = _service(idle_s=0.4, handshake_s=30.0)
    ctx = zmq.Context()
    raw = _flood(svc, 2)
    silent = ctx.socket(zmq.DEALER)  # a zmq client: it finishes its handshake, then says nothing
    silent.setsockopt(zmq.RECONNECT_IVL, -1)  # and stays away once closed (libzmq would reconnect it)
    silent.setsockopt(zmq.LINGER, 0)
    silent.connect(svc.address)
    talking = _raw_socket(ctx, svc.address)  # reconnects if closed: one more idle close to count
    try:
        deadline = time.monotonic() + 1.2
        while time.monotonic() < deadline:
            hello(talking)  # a request every 0.1 s: never idle
            time.sleep(0.1)
        stats = _until(svc, "connections_closed_idle", 3)
        assert stats["connections_closed_idle"] == 3 and stats["connections_closed_cap"] == 0
        assert _closed(raw) == [True, True]
        assert hello(talking)  # still served
    finally:
        for s in raw:
            s.close()
        silent.close(0)
        talking.close(0)
        ctx.term()
        svc.stop()


def test_a_connection_that_never_finishes_its_handshake_is_closed_by_libzmq():
    svc = _service(idle_s=60.0, handshake_s=0.3)
    try:
        raw = _flood(svc, 3)
        stats = _until(svc, "connections_closed_handshake", 3)
        assert stats["connections_closed_handshake"] == 3 and stats["connections_closed_idle"] == 0
        assert _closed(raw) == [True] * 3
        garbage = _flood(svc, 1)[0]
        garbage.sendall(b"\xff" + bytes(8) + b"\x7f\x03" + bytes(60))  # a ZMTP greeting naming no mechanism
        assert _until(svc, "handshake_failed", 1)["handshake_failed"] == 1
        for s in raw + [garbage]:
            s.close()
    finally:
        svc.stop()


def test_the_caps_fit_the_open_files_limit(monkeypatch, caplog):
    limits = {"now": (1024, 1024)}
    monkeypatch.setattr(connections, "_open_descriptors", lambda: 100)
    monkeypatch.setattr(connections.resource, "getrlimit", lambda _: limits["now"])
    monkeypatch.setattr(connections.resource, "setrlimit", lambda _, v: limits.__setitem__("now", v))
    with caplog.at_level(logging.WARNING, logger="flash.buffers.connections"):
        assert fit_caps(1024, 256) == (462, 256)  # half the 924 descriptors left; the hard limit holds
    assert "at most 462 connections, not 1024 (raise the open-files limit, ulimit -n" in caplog.text
    limits["now"] = (1024, 1 << 20)
    assert fit_caps(1024, 256) == (1024, 256) and limits["now"] == (100 + 2 * 1024, 1 << 20)  # raised
    limits["now"] = (110, 110)
    assert fit_caps(1024, 256) == (8, 8)  # never below 8
    with pytest.raises(ValueError, match="buffer.max_connections must be >= 1"):
        from flash.buffers.factory import BufferConfig

        BufferConfig(transport="zmq", max_connections=0)
