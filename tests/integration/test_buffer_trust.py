"""The buffer service trusts no client: who may connect, who may close, what may be stored.

Each test is one attack from outside the run (no keys, a producer's keys but not the owner's
token, a replay under another id, values no engine produces, a long-poll that never ends, one
client holding every waiter slot, a frame of empty arrays, a frame beyond MAXMSGSIZE) and pins
the named outcome, and that the service goes on serving the run's own clients.
"""

from __future__ import annotations

import resource

import msgpack
import numpy as np
import pytest
import zmq

from flash.buffers.auth import ServiceKeys, check_bind, is_loopback
from flash.buffers.client import RemoteSampleBuffer
from flash.buffers.factory import BufferConfig
from flash.buffers.guard import ProducerTable, ValueLimits, check_values
from flash.buffers.producer import BufferProducer
from flash.buffers.service import MAX_WAIT_MS, BufferService
from flash.buffers.wire import WireError, pack, unpack
from tests.helpers.wire import MB, _raw_socket, answers, hello, make_group, put_parts


@pytest.fixture
def curve():
    """A CURVE service (run keys, owner token) and a raw client holding the run's client keys."""
    keys = ServiceKeys.new()
    svc = BufferService(capacity=16, keys=keys, owner_token=b"t" * 16, limits=ValueLimits(vocab_size=50_000))
    svc.max_version = lambda: 3
    svc.start()
    ctx = zmq.Context()
    sock = _raw_socket(ctx, svc.address, keys.client)
    yield svc, keys, sock
    sock.close(0)
    ctx.term()
    svc.stop()


def stores_the_next_groups_once(svc, keys) -> None:
    """After an attack: a fresh producer's groups are each stored once and taken once."""
    before = {m.prompt_id for m in svc.buffer.meta()[2]}
    producer = BufferProducer(svc.address, keys=keys.client if keys else None)
    for pid in (900, 901):
        producer.put(make_group(pid))
    producer.flush()
    producer.close()
    new = [m for m in svc.buffer.meta()[2] if m.prompt_id not in before]
    assert sorted(m.prompt_id for m in new) == [900, 901]
    assert sorted(g.prompt_id for g, _ in svc.buffer.take([m.key for m in new])) == [900, 901]


def ask(sock, message: dict) -> dict:
    sock.send(pack({"rid": 5, **message}))
    return unpack(sock.recv(), MB)


def test_a_client_without_the_run_keys_is_never_served(curve):
    svc, keys, sock = curve
    ctx = zmq.Context()
    strangers = [_raw_socket(ctx, svc.address)]  # plaintext
    other = ServiceKeys.new()  # the right server key, a client key the run never made
    strangers.append(
        _raw_socket(
            ctx,
            svc.address,
            type(keys.client)(keys.server_public, other.client.client_public, other.client.client_secret),
        )
    )
    for s in strangers:
        try:  # a refused handshake may already have dropped the pipe: nothing to queue on
            s.send(pack({"op": "stats", "rid": 1}), zmq.DONTWAIT)
        except zmq.Again:
            pass
        assert s.poll(500) == 0  # no reply: the handshake failed before a frame was read
        s.close(0)
    ctx.term()
    assert svc.stats()["frames_in"] == 0
    assert ask(sock, {"op": "stats"})["status"] == "ok"  # the run's client is served
    consumer = RemoteSampleBuffer(svc.address, keys=keys.client)
    BufferProducer(svc.address, keys=keys.client).put(make_group(1))
    assert [g.prompt_id for g in consumer.get_batch(1, timeout=5)] == [1]
    consumer.disconnect()
    stores_the_next_groups_once(svc, keys)


def test_only_the_owner_closes_or_drains(curve):
    svc, keys, sock = curve
    p = hello(sock)
    sock.send_multipart(put_parts(p, 0, make_group(1)))
    assert answers(sock, 1)[0]["status"] == "stored"
    for op in ("close", "drain"):
        reply = ask(sock, {"op": op, "token": b"x" * 16})
        assert (reply["status"], reply["reason"]) == ("rejected", "not_owner")
    assert not svc.buffer.meta()[1] and len(svc.buffer) == 1  # meta: (epoch, closed, groups)
    owner = RemoteSampleBuffer(svc.address, keys=keys.client, owner_token=b"t" * 16)
    assert [g.prompt_id for g in owner.drain()] == [1]
    owner.close()
    assert svc.buffer.meta()[1] and svc.stats()["rejected_not_owner"] == 2
    owner.disconnect()


def test_producer_ids_come_from_the_service_and_a_replay_is_not_a_second_group(curve):
    svc, _, sock = curve
    sock.send_multipart(put_parts("chosen-by-me", 0, make_group(1)))
    assert answers(sock, 1)[0]["reason"] == "unknown_producer"
    a, b = hello(sock), hello(sock)
    assert a != b and len(a) == 24
    sock.send_multipart(put_parts(a, 0, make_group(1)))
    sock.send_multipart(put_parts(b, 0, make_group(1)))  # the same group under another producer
    got = answers(sock, 2)
    assert [g["status"] for g in got] == ["stored", "rejected"] and got[1]["reason"] == "duplicate_prompt"
    assert len(svc.buffer) == 1
    stores_the_next_groups_once(svc, curve[1])


def bad_groups():
    """Groups whose schema is fine and whose values no engine produces (name -> group)."""
    out = {}
    for name, field, value in [
        ("nan reward", "reward", float("nan")),
        ("inf logprob", "behav_logprobs", None),
        ("negative version", "versions", -100),
        ("future version", "versions", 4),
        ("token past the vocabulary", "response_ids", 50_000),
        ("negative token", "prompt_ids", -1),
    ]:
        g = make_group(len(out) + 10)
        s = g.samples[0]
        if field == "reward":
            s.reward = value
        elif field == "behav_logprobs":
            s.behav_logprobs = list(s.behav_logprobs[:-1]) + [float("-inf")]
        else:
            setattr(s, field, list(getattr(s, field)[:-1]) + [value])
        out[name] = g
    version = make_group(30, version=0)
    version.admitted_version = -100
    out["admitted version -100"] = version
    return out


def test_values_no_engine_produces_are_refused_and_never_selected(curve):
    svc, _, sock = curve
    p = hello(sock)
    bad = bad_groups()
    groups = [make_group(1, version=2), *bad.values(), make_group(2, version=2)]
    sock.send_multipart(put_parts(p, 0, *groups))
    got = answers(sock, len(groups))
    assert [g["status"] for g in got] == ["stored"] + ["rejected"] * len(bad) + ["stored"]
    assert {g["reason"] for g in got[1:-1]} == {"bad_value"}
    assert svc.stats()["rejected_bad_value"] == len(bad)
    assert sorted(m.prompt_id for m in svc.buffer.meta()[2]) == [1, 2]
    stores_the_next_groups_once(svc, curve[1])


def test_long_polls_are_bounded_in_time_and_per_client(curve):
    svc, keys, sock = curve
    for wait_ms in (2**63 - 1, MAX_WAIT_MS + 1, -1):
        reply = ask(sock, {"op": "meta", "since": 0, "wait_ms": wait_ms})
        assert (reply["status"], reply["reason"]) == ("rejected", "bad_value")
    for _ in range(svc.max_waiters_per_client):  # park as many as a client may
        sock.send(pack({"op": "meta", "rid": 9, "since": svc.buffer.meta()[0], "wait_ms": 5000}))
    reply = ask(sock, {"op": "meta", "since": svc.buffer.meta()[0], "wait_ms": 5000})
    assert (reply["status"], reply["reason"]) == ("rejected", "too_many_waiters")
    ctx = zmq.Context()
    other = _raw_socket(ctx, svc.address, keys.client)  # another client still gets a slot
    other.send(pack({"op": "meta", "rid": 1, "since": svc.buffer.meta()[0], "wait_ms": 100}))
    assert unpack(other.recv(), MB)["status"] == "ok"  # answered at its deadline
    other.close(0)
    ctx.term()
    assert svc.stats()["waiters"] == svc.max_waiters_per_client
    stores_the_next_groups_once(svc, keys)


def test_a_frame_of_empty_arrays_is_refused_without_building_it(curve):
    _, _, sock = curve
    p = hello(sock)
    frame = msgpack.packb([[] for _ in range(1 << 16)] * 200)  # ~13 MB: 13M empty lists if built
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    sock.send_multipart([pack({"op": "put", "rid": 0, "producer": p, "seq": 0}), frame])
    got = answers(sock, 1)[0]
    grew_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert got["status"] == "rejected" and got["reason"] in ("bad_schema", "truncated")
    assert grew_mb < 200  # 13M lists would take ~900 MB
    nested = msgpack.packb([[[] for _ in range(4096)] for _ in range(4096)])  # each array within bounds
    sock.send_multipart([pack({"op": "put", "rid": 0, "producer": p, "seq": 1}), nested])
    assert answers(sock, 1)[0]["reason"] == "bad_schema"
    with pytest.raises(WireError, match="more than 1048576 values in one frame"):
        unpack(nested, 64 * MB)
    stores_the_next_groups_once(curve[0], curve[1])


def test_a_frame_beyond_maxmsgsize_drops_its_sender_and_the_service_serves_on():
    keys = ServiceKeys.new()
    with BufferService(capacity=4, keys=keys, max_frame_bytes=64 << 10) as svc:
        ctx = zmq.Context()
        big = _raw_socket(ctx, svc.address, keys.client)
        big.send_multipart([pack({"op": "stats", "rid": 1}), np.zeros(2 << 20, np.uint8).tobytes()])
        assert big.poll(500) == 0  # disconnected by libzmq, nothing read
        assert svc.stats()["frames_in"] == 0
        ok = _raw_socket(ctx, svc.address, keys.client)
        assert ask(ok, {"op": "stats"})["status"] == "ok"
        stores_the_next_groups_once(svc, keys)
        big.close(0)
        ok.close(0)
        ctx.term()


def test_the_producer_table_is_bounded_and_expires_the_silent():
    table = ProducerTable(max_producers=3, expire_s=60)
    ids = [table.issue(now=t) for t in (0, 1, 2)]
    with pytest.raises(WireError, match="too_many_producers"):
        table.issue(now=30)  # all three heard from within a minute
    table.last_seq(ids[0], now=50)  # the first one speaks: the second is now the longest silent
    new = table.issue(now=65)
    assert len(table) == 3 and new not in ids
    with pytest.raises(WireError, match="unknown_producer"):
        table.last_seq(ids[1])
    assert table.last_seq(ids[0]) == -1 and table.last_seq(ids[2]) == -1


def test_a_plaintext_service_beyond_loopback_is_refused_at_validate():
    assert is_loopback("tcp://127.0.0.1:0") and is_loopback("tcp://[::1]:5") and is_loopback("ipc:///tmp/x")
    assert not is_loopback("tcp://0.0.0.0:0") and not is_loopback("tcp://*:5555") and not is_loopback("tcp://eth0:1")
    with pytest.raises(ValueError, match="buffer.auth=none: any host could put, take or close"):
        BufferConfig(transport="zmq", bind="tcp://0.0.0.0:0", auth="none")
    BufferConfig(transport="zmq", bind="tcp://0.0.0.0:0")  # CURVE by default: allowed
    BufferConfig(transport="zmq", bind="tcp://127.0.0.1:0", auth="none")
    with pytest.raises(ValueError, match="buffer.auth must be one of: curve, none"):
        check_bind("tcp://127.0.0.1:0", "tls")


def test_value_checks_on_arrays_of_every_integer_width_and_float_dtype():
    """The range check reads integers as unsigned (one pass): a negative must still be refused at
    every width, with or without a vocabulary bound, and a clean group must pass."""
    for vocab in (None, 50_000):
        limits = ValueLimits(vocab_size=vocab)
        for dtype in (np.int8, np.int16, np.int32, np.int64):
            g = make_group(5, arrays=True)
            s = g.samples[0]
            s.prompt_ids = np.array([3, 7], dtype=dtype)
            s.response_ids = s.response_ids.astype(np.int64).clip(0, 100).astype(dtype)
            s.versions = s.versions.astype(dtype)
            check_values(g, limits, max_version=1)
            for field, value, message in (
                ("response_ids", -1, "response_ids holds -1 < 0"),
                ("versions", -3, "versions holds -3 < 0"),
                ("versions", 2, "versions holds 2 > 1"),
            ):
                spoiled = getattr(s, field).copy()
                spoiled[-1] = value
                setattr(s, field, spoiled)
                with pytest.raises(WireError, match=message):
                    check_values(g, limits, max_version=1)
                setattr(s, field, getattr(s, field).clip(0, 1))
    g = make_group(6, arrays=True)
    g.samples[0].response_ids[2] = 50_000
    with pytest.raises(WireError, match="response_ids holds 50000 > 49999"):
        check_values(g, ValueLimits(vocab_size=50_000), max_version=1)
    for dtype in (np.float16, np.float32, np.float64):
        g = make_group(7, arrays=True)
        g.samples[1].behav_logprobs = g.samples[1].behav_logprobs.astype(dtype)
        check_values(g, ValueLimits(), max_version=1)
        g.samples[1].behav_logprobs[0] = np.nan
        with pytest.raises(WireError, match="group 7 sample 1: behav_logprobs holds NaN or inf"):
            check_values(g, ValueLimits(), max_version=1)
