"""A frame the buffer service refuses costs it a small multiple of the frame's size, never what the
frame would decode to: the decoded-bytes budget holds while the frame is decoded, and a frame cut
short is found so before msgpack allocates what its headers declare (``flash.buffers.frame_scan``)."""

from __future__ import annotations

import functools
import gc
import struct
import tracemalloc

import msgpack
import pytest
import zmq

from flash.buffers.frame_scan import MAX_VALUES, frame_cost, scan
from flash.buffers.service import BufferService
from flash.buffers.wire import Budget, WireError, unpack
from tests.helpers.wire import MB, _raw_socket, answers, hello, make_group, put_parts


def _nested(depth: int, items: int) -> bytes:
    """``depth`` array32 headers, each declaring ``items`` items, and nothing else."""
    return b"".join(b"\xdd" + struct.pack(">I", items) for _ in range(depth))


# (frame, the budget it is decoded under, the reason it is refused); before the budget held while
# decoding, each peaked at the multiple of its size noted (tracemalloc, CPython 3.11)
HOSTILE = {
    "headers declaring 4,900 items, cut short": (_nested(1000, 4900), 1 << 40, "truncated"),  # 7,850x
    "a list of negative fixints": (msgpack.packb([-20] * 65_535), 8, "oversized_decoded"),  # 40x
    "a list of uint16s": (msgpack.packb([40_000] * 65_535), 8, "oversized_decoded"),  # 13x
    "a list of two-letter strs": (msgpack.packb(["ab"] * 65_535), 8, "oversized_decoded"),  # 20x
    "a map of many keys": (msgpack.packb({f"{i:x}": None for i in range(65_535)}), 8, "oversized_decoded"),  # 28x
    "lists of lists": (msgpack.packb([[-20, -21, -22, -23]] * 65_535), 8, "oversized_decoded"),  # 2.4x
}


def _peak(fn) -> int:
    """The most ``fn`` had allocated at once (tracemalloc, every thread), the cyclic collector off."""
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
        gc.enable()


@pytest.mark.parametrize("name", HOSTILE)
def test_a_refused_frame_costs_a_small_multiple_of_its_size(name):
    frame, per_byte_or_limit, reason = HOSTILE[name]
    limit = per_byte_or_limit * len(frame) if per_byte_or_limit < 1024 else per_byte_or_limit

    def refused():
        with pytest.raises(WireError) as err:
            unpack(frame, 64 * MB, Budget(limit))
        assert err.value.reason == reason

    peak = _peak(refused)
    # one copy of the frame (msgpack's C walk reads its own), msgpack's ~48 KiB walk stack, and
    # room for what other threads allocate meanwhile (tracemalloc sees them all)
    assert peak <= len(frame) + (256 << 10), (name, peak, len(frame))


def test_the_walk_finds_a_cut_frame_and_bounds_its_own_work():
    # over FAST_BYTES: walked, and each header's length checked against the bytes left
    with pytest.raises(WireError, match="truncated: a header declares 2000000 items with 1500000 bytes left"):
        unpack(_nested(1, 2_000_000) + bytes(1_500_000), 64 * MB, Budget(1 << 40))
    with pytest.raises(WireError, match="truncated: the last value runs past the frame's end"):
        unpack(msgpack.packb([b"x" * 1000] * 2000)[:-1], 64 * MB, Budget(1 << 40))
    assert frame_cost(msgpack.packb([1, 2]), 1 << 40) is None  # small and whole: msgpack's C walk
    many = msgpack.packb([[0] * 65_535] * 17)  # 1.1 M values, 1.1 MB
    with pytest.raises(WireError, match=f"bad_schema: more than {MAX_VALUES} values in one frame"):
        unpack(many, 64 * MB, Budget(1 << 40))
    assert scan(msgpack.packb({"a": [1, [2]], "b": b"x" * 300}), 1 << 40) == (64 + 2 * 272) + (56 + 2 * 88) + (56 + 88)


@pytest.fixture
def plain():
    """A plaintext service with small caps: 64 KiB groups, 256 KiB messages, 512 KiB decoded."""
    svc = BufferService(
        capacity=8, max_frame_bytes=64 << 10, max_message_bytes=256 << 10, max_decoded_bytes=512 << 10
    ).start()
    ctx = zmq.Context()
    sock = _raw_socket(ctx, svc.address)
    yield svc, sock
    sock.close(0)
    ctx.term()
    svc.stop()


def test_the_service_refuses_a_hostile_put_without_building_it(plain):
    svc, sock = plain
    p = hello(sock)
    frames = {
        "malformed": b"\xc1",  # what any refused message costs the service: ~260 KB
        "fixints": msgpack.packb([-20] * 60_000),  # 60 KB: 2.4 MB of ints and slots if built
        "cut": _nested(1000, 4900),
    }  # 5 KB: 39 MB of list slots if msgpack is handed it
    got: list[dict] = []

    def put(frame: bytes, seq: int):
        sock.send_multipart([put_parts(p, seq)[0], frame])
        got.extend(answers(sock, 1))

    peaks = [_peak(functools.partial(put, frame, seq)) for seq, frame in enumerate(frames.values())]
    # the cut frame's second header already declares more than the message may decode to
    assert [a["reason"] for a in got] == ["malformed", "oversized_decoded", "oversized_decoded"]
    for peak, frame in zip(peaks[1:], list(frames.values())[1:]):
        assert peak - peaks[0] < len(frame) + (64 << 10), peaks
    sock.send_multipart(put_parts(p, 3, make_group(7)))  # and the service serves on
    assert answers(sock, 1)[0]["status"] == "stored"
    assert svc.stats()["rejected_oversized_decoded"] == 2
