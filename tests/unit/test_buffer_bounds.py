"""What one client holding the run's keys can make the buffer service hold: bounded and counted.

A message's parts together are capped (``max_message_bytes``) and so is what its frames decode to
(``max_decoded_bytes``, a ``flash.buffers.wire.Budget`` charged before each thing is built: a frame from
its worst case or, where that does not fit, from its headers, ``flash.buffers.frame_scan``); producer
ids are capped per client, and a full table takes room from the client holding the most. Each
refusal is answered by name, counted, and the service goes on storing an honest producer's groups.
"""

from __future__ import annotations

import gc
import tracemalloc

import msgpack
import numpy as np
import pytest
import zmq

from flash.buffers.auth import ServiceKeys
from flash.buffers.client import BufferProducer
from flash.buffers.factory import BufferConfig
from flash.buffers.frame_scan import FRAME_BYTES, MOST_PER_BYTE
from flash.buffers.guard import ProducerTable
from flash.buffers.service import DECODED_PER_BYTE, BufferService, message_caps
from flash.buffers.wire import Budget, WireError, decode_group, encode_group, pack, unpack
from tests.helpers.wire import MB, _raw_socket, answers, hello, make_group, put_parts

rng = np.random.default_rng(0)
# plain msgpack payloads that expand when decoded, ~100 KB on the wire, each 8+ containers
PAYLOADS = {
    "uint16 ints": [rng.integers(256, 65_536, 4000).tolist() for _ in range(8)],  # 3 bytes -> 36
    "float32s": [rng.random(2500).astype(np.float32).tolist() for _ in range(8)],  # 5 bytes -> 32
    "negative fixints": [[-20] * 6000 for _ in range(8)],  # 1 byte -> 36: not a shared int
    "nested lists": [[[i, [i]] for i in range(500)] for _ in range(10)],
    "maps of many keys": [{f"k{j}.{i}": i for i in range(2000)} for j in range(8)],
    "short strs": [[f"{i:02x}"[-2:] + "é" for i in range(2500)] for _ in range(8)],
    "ascii widened by one emoji": ["a" * 12_500 + "\U0001f600" for _ in range(8)],  # 1 byte per char -> 4
    "bins": [bytes(1000) for _ in range(100)],
}


def _packed(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _traced(fn):
    """(fn(), bytes it left allocated, its peak) under tracemalloc; the cyclic collector held off
    (collecting earlier tests' garbage meanwhile would read as negative allocations)."""
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        out = fn()
        now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        gc.enable()
    return out, now - before, peak - before


@pytest.mark.parametrize("name", PAYLOADS)
def test_a_frame_is_charged_at_least_what_decoding_allocates_and_refused_before_it_is_built(name):
    frame = _packed(PAYLOADS[name])
    # msgpack interns map keys: a first decode grows the interpreter's global table of interned
    # strings, whose size depends on what the process imported before (torch: twice the table),
    # not on the frame; decoding once first keeps that growth out of what is measured.
    unpack(frame, 64 * MB)
    most = FRAME_BYTES + MOST_PER_BYTE * len(frame)
    fast = Budget(most)  # its worst case fits: checked whole in C, each container counted as built
    assert unpack(frame, 64 * MB, fast) == PAYLOADS[name]
    walked = Budget(most - 1)  # it does not: its headers are walked, each container charged first
    value, held, _ = _traced(lambda: unpack(frame, 64 * MB, walked))
    assert value == PAYLOADS[name] and walked.spent == fast.spent  # the same costs either way
    assert held <= walked.spent <= 6 * held + (1 << 16), (name, walked.spent, held)
    unpack(frame, 64 * MB, Budget(walked.spent))  # exactly the cap: decoded
    _, _, peak = _traced(lambda: _refused(frame, walked.spent - 1))
    assert peak < 8 << 10, (name, peak)  # one byte short: refused before anything is built


def _refused(frame: bytes, cap: int) -> None:
    with pytest.raises(WireError, match="oversized_decoded"):
        unpack(frame, 64 * MB, Budget(cap))


@pytest.mark.parametrize("length,arrays", [(4096, False), (4096, True), (20_000, False)])
def test_a_groups_lists_and_runs_are_charged_from_their_headers_before_they_are_built(length, arrays):
    g = make_group(3, n=4, length=length, arrays=arrays)  # versions of 2,048+ tokens travel as runs
    frame = encode_group(g)
    budget = Budget(1 << 40)
    group, held, _ = _traced(lambda: decode_group(unpack(frame, 64 * MB, budget), budget=budget))
    assert np.array_equal(group.samples[3].response_ids, g.samples[3].response_ids)
    assert budget.spent >= held, (budget.spent, held)
    if not arrays:  # lists: ~20 bytes of objects per byte of frame, under the default ratio
        assert 10 * len(frame) < budget.spent < DECODED_PER_BYTE * len(frame)
    raw = unpack(frame, 64 * MB)
    _, _, peak = _traced(lambda: _refused_group(raw, Budget(1000)))  # less than one expanded array
    assert peak < 16_000  # refused before the lists (or the runs: 4 bytes a token) were built


def _refused_group(raw, budget: Budget) -> None:
    with pytest.raises(WireError, match="oversized_decoded"):
        decode_group(raw, budget=budget)


@pytest.fixture
def small():
    """A CURVE service with small caps: 64 KiB groups, 256 KiB messages, 512 KiB decoded."""
    keys = ServiceKeys.new()
    svc = BufferService(
        capacity=64,
        keys=keys,
        max_frame_bytes=64 << 10,
        max_message_bytes=256 << 10,
        max_decoded_bytes=512 << 10,
        producers_per_client=4,
    ).start()
    ctx = zmq.Context()
    sock = _raw_socket(ctx, svc.address, keys.client)
    yield svc, keys, sock, ctx
    sock.close(0)
    ctx.term()
    svc.stop()


def stores_the_next_groups_once(svc, keys, first: int = 900) -> None:
    producer = BufferProducer(svc.address, max_frame_mb=0.0625, keys=keys.client)
    for pid in (first, first + 1):
        producer.put(make_group(pid, length=50))
    producer.flush()
    producer.close()
    assert {first, first + 1} <= {m.prompt_id for m in svc.buffer.meta()[2]}


@pytest.mark.parametrize("parts,length", [(8, 1500), (60, 200), (1000, 5)])
def test_a_put_whose_parts_together_pass_the_cap_is_refused_group_by_group(small, parts, length):
    svc, keys, sock, _ = small
    p = hello(sock)
    groups = [make_group(10 + i, length=length) for i in range(parts)]
    message = put_parts(p, 0, *groups)
    assert sum(map(len, message)) > svc.max_message_bytes and max(map(len, message)) <= svc.max_frame_bytes
    sock.send_multipart(message)
    got = answers(sock, parts)
    assert {(a["status"], a["reason"]) for a in got} == {("rejected", "oversized_message")}
    assert svc.stats()["rejected_oversized_message"] == parts and len(svc.buffer) == 0
    sock.send_multipart(put_parts(p, parts, make_group(5)))  # the seqs were decided: the next one is stored
    assert answers(sock, 1)[0]["status"] == "stored"
    stores_the_next_groups_once(svc, keys)


def test_one_part_past_the_frame_cap_or_past_maxmsgsize(small):
    svc, keys, sock, ctx = small
    p = hello(sock)
    huge = make_group(1, length=6000)  # ~100 KB: over the group cap, under the message cap
    sock.send_multipart(put_parts(p, 0, huge))
    assert answers(sock, 1)[0]["reason"] == "oversized"
    big = _raw_socket(ctx, svc.address, keys.client)  # one part past the message cap: libzmq drops it
    big.send_multipart([pack({"op": "stats", "rid": 1}), bytes(svc.max_message_bytes + 1)])
    assert big.poll(500) == 0
    big.close(0)
    stores_the_next_groups_once(svc, keys)


def test_a_group_decoding_past_the_budget_is_refused_and_the_rest_of_its_put_stored(small):
    svc, keys, sock, _ = small
    p = hello(sock)
    fat = make_group(2, length=5)
    fat.samples[0].meta["ids"] = rng.integers(
        256, 65_536, 20_000
    ).tolist()  # 60 KB of uint16s: 720 KB decoded, 2 MB charged
    under = make_group(3, length=5)
    under.samples[0].meta["ids"] = fat.samples[0].meta["ids"][:2000]
    sock.send_multipart(put_parts(p, 0, make_group(1), fat, under, make_group(4)))
    got = answers(sock, 4)
    assert [a["status"] for a in got] == ["stored", "rejected", "stored", "stored"]
    assert got[1]["reason"] == "oversized_decoded" and svc.stats()["rejected_oversized_decoded"] == 1
    header = {"op": "take", "rid": 3, "keys": list(range(1000, 16_000)), "consumer": "c", "tid": 0}
    sock.send(pack(header))  # a control message is charged too
    assert unpack(sock.recv(), MB)["reason"] == "oversized_decoded"
    stores_the_next_groups_once(svc, keys)


def test_one_client_flooding_hellos_is_capped_and_another_still_registers(small):
    svc, keys, sock, ctx = small
    got = []
    for _ in range(20):
        sock.send(pack({"op": "hello", "rid": 1}))
        got.append(unpack(sock.recv(), MB))
    assert [g["status"] for g in got] == ["ok"] * 4 + ["rejected"] * 16
    assert {g["reason"] for g in got[4:]} == {"producers_per_client"}
    assert svc.stats()["rejected_producers_per_client"] == 16 and svc.stats()["producers"] == 4
    other = _raw_socket(ctx, svc.address, keys.client)  # the same run key, another client
    assert hello(other) and svc.stats()["producers"] == 5
    other.close(0)
    stores_the_next_groups_once(svc, keys)


def test_a_full_table_takes_room_from_the_client_holding_the_most():
    table = ProducerTable(max_producers=8, expire_s=600, per_client=4, pressure_idle_s=60)
    flood = {c: [table.issue(c, now=0) for _ in range(4)] for c in (b"a", b"b")}  # full
    honest = [table.issue(c, now=1) for c in (b"x", b"y", b"z")]  # each evicts one flooder id
    assert len(table) == 8 and table.evicted == 3
    for pid in honest:
        assert table.last_seq(pid, now=2) == -1
    assert sorted(sum(pid in table._table for pid in ids) for ids in flood.values()) == [2, 3]
    table.issue(b"x", now=3)  # x's second id still comes out of b's three
    with pytest.raises(WireError, match="too_many_producers"):  # but not a third: no one holds more than x
        table.issue(b"x", now=3)
    assert table.evicted == 4
    with pytest.raises(WireError, match="producers_per_client"):
        table = ProducerTable(per_client=4)
        for _ in range(5):
            table.issue(b"x")
    # one id per client everywhere: no client holds more, so only the idle give way
    table = ProducerTable(max_producers=3, expire_s=600, per_client=4, pressure_idle_s=60)
    ids = [table.issue(c, now=0) for c in (b"a", b"b", b"c")]
    with pytest.raises(WireError, match="too_many_producers"):
        table.issue(b"d", now=30)
    table.last_seq(ids[0], now=40)
    table.issue(b"d", now=61)  # b's id, silent for 61 s, gives way under pressure
    with pytest.raises(WireError, match="unknown_producer"):
        table.last_seq(ids[1])
    assert table.evicted == 1 and table.last_seq(ids[2]) == -1


def test_caps_are_settings_derived_from_the_frame_and_batch_sizes():
    assert message_caps(64 * MB) == (65 * MB, DECODED_PER_BYTE * 65 * MB)
    assert message_caps(MB, batch_bytes=4 * MB, max_decoded_bytes=7) == (5 * MB, 7)
    assert message_caps(MB, max_message_bytes=3 * MB) == (3 * MB, DECODED_PER_BYTE * 3 * MB)
    with pytest.raises(ValueError, match=r"buffer.max_message_mb must be 0 \(auto\) or >= buffer.max_frame_mb"):
        BufferConfig(transport="zmq", max_frame_mb=8, max_message_mb=4)
    with pytest.raises(ValueError, match="buffer.max_decoded_mb must be >= 0"):
        BufferConfig(transport="zmq", max_decoded_mb=-1)
    with pytest.raises(ValueError, match="buffer.producers_per_client must be >= 1"):
        BufferConfig(transport="zmq", producers_per_client=0)
