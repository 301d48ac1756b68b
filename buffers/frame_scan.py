"""What a msgpack frame may decode to, bounded before anything is decoded (``frame_cost``).

msgpack's own limits (``max_array_len`` and the like) hold per object, its hooks run once a
container is built, and it allocates a container's slots from the length its header declares,
before the items arrive: a frame of nested headers declaring 5,000 items each, cut short, makes it
allocate ~8,000 times the frame's size before it finds the frame incomplete. So a frame goes to
msgpack only once it is known whole and paid for, one of two ways:

- at most ``FAST_BYTES``, and its worst case fits what is left of the budget (``FRAME_BYTES`` +
  ``MOST_PER_BYTE`` a byte: no value costs more per byte of the frame than a map inside a map):
  msgpack's C walk (``Unpacker.skip``, which builds nothing) checks it whole, with no bytes left
  over, and msgpack's hooks count what it builds (``Tally``), which cannot pass the room;
- any other is walked here, header by header (``scan``): every length checked against the bytes
  left, every list and map charged at its header from the length it declares, and the walk stops
  at the first charge past the room.

Either way a refused frame costs a walk over its bytes (and, below ``FAST_BYTES``, one copy of
them), never the values it would decode to.

What a value costs (upper bounds of what msgpack builds, in bytes; CPython, 64-bit): a list
``LIST_BYTES`` and ``ITEM_BYTES`` an item (its slot, and the object: an int ≤ 36, a float 24, a
str's or bytes' header ≤ 80); a map ``MAP_BYTES`` and ``ENTRY_BYTES`` an entry (key and value,
and its share of the table, counted twice: msgpack interns keys); ``FRAME_BYTES`` a frame (a value
outside any container, the interpreter's bookkeeping) and its bytes ``WIDEN`` times (a str's
characters take up to 4 bytes each: one past U+FFFF widens all).

The walk's work is bounded too: at most ``MAX_ARRAY`` items in one container and ``MAX_VALUES``
values in one frame (a group's arrays travel as bytes: an honest frame holds a few dozen values a
sample); a frame of ``FAST_BYTES`` cannot hold more.
"""

from __future__ import annotations

import threading

import msgpack

LIST_BYTES, MAP_BYTES, ITEM_BYTES, ENTRY_BYTES, WIDEN, FRAME_BYTES = 56, 64, 88, 272, 4, 1024
# the most one byte of a frame is charged: a map header (the map) that is a key or value of a map
# (half an entry), its bytes widened
MOST_PER_BYTE = MAP_BYTES + ENTRY_BYTES // 2 + WIDEN
MAX_ARRAY = 1 << 16  # items of one msgpack array or map
MAX_VALUES = 1 << 20  # values in one frame: containers and the items they declare
FAST_BYTES = MAX_VALUES  # a frame no larger holds no more values (each takes a byte at least)


class FrameRefused(ValueError):
    """A frame the scan refuses before decoding; ``reason`` is one of ``flash.buffers.wire.REASONS``."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def _tables() -> tuple[bytes, bytes]:
    """Per first byte: the bytes a value of fixed size takes, header included (0: not one), and
    how many bytes its length takes for a str/bin (1, 2, 4), an array (array16/32: 2, 4; fixarray:
    ``_FIX``) or a map, with its kind (``_BIN``, ``_ARRAY``, ``_MAP``; ``_BAD``: ext or 0xc1)."""
    size, kind = bytearray(256), bytearray(256)
    for b in [*range(0x00, 0x80), *range(0xE0, 0x100), 0xC0, 0xC2, 0xC3]:
        size[b] = 1  # fixints, nil, false, true
    for b in range(0xA0, 0xC0):
        size[b] = 1 + (b & 0x1F)  # fixstr
    for b, n in (
        (0xCC, 2),
        (0xD0, 2),
        (0xCD, 3),
        (0xD1, 3),
        (0xCA, 5),
        (0xCE, 5),
        (0xD2, 5),
        (0xCB, 9),
        (0xCF, 9),
        (0xD3, 9),
    ):
        size[b] = n  # float32/64, uint8..64, int8..64
    for b, width in ((0xC4, 1), (0xC5, 2), (0xC6, 4), (0xD9, 1), (0xDA, 2), (0xDB, 4)):
        kind[b] = _BIN | width
    for b in range(0x80, 0x90):
        kind[b] = _MAP | _FIX
    for b in range(0x90, 0xA0):
        kind[b] = _ARRAY | _FIX
    kind[0xDC], kind[0xDD], kind[0xDE], kind[0xDF] = _ARRAY | 2, _ARRAY | 4, _MAP | 2, _MAP | 4
    for b in [0xC1, *range(0xC7, 0xCA), *range(0xD4, 0xD9)]:
        kind[b] = _BAD
    return bytes(size), bytes(kind)


_FIX, _BIN, _ARRAY, _MAP, _BAD = 8, 16, 32, 64, 128  # flags in a kind byte; its low bits: a length's width
_SIZE, _KIND = _tables()


def frame_cost(frame: bytes | memoryview, room: int) -> int | None:
    """What decoding ``frame`` takes at most, in bytes, read from its headers; None where the frame
    is whole and even its worst case fits ``room`` (a ``Tally`` then counts what msgpack builds);
    ``FrameRefused`` names why neither (see the module docstring)."""
    size = len(frame)
    if size <= FAST_BYTES and FRAME_BYTES + MOST_PER_BYTE * size <= room:
        _whole(frame)
        return None
    fixed = FRAME_BYTES + WIDEN * size
    if fixed > room:
        raise _over(room)
    return fixed + scan(frame, room - fixed)


class Tally:
    """msgpack's list and map hooks for a frame ``frame_cost`` let through whole: ``total`` is then
    what the frame was charged had it been walked (the same costs, from the built containers)."""

    __slots__ = ("total",)

    def __init__(self, size: int):
        self.total = FRAME_BYTES + WIDEN * size

    def on_list(self, value: list) -> list:
        self.total += LIST_BYTES + ITEM_BYTES * len(value)
        return value

    def on_map(self, value: dict) -> dict:
        self.total += MAP_BYTES + ENTRY_BYTES * len(value)
        return value


def _whole(frame: bytes | memoryview) -> None:
    """One value, whole, and nothing after it: msgpack's C walk, which builds nothing. Each thread
    keeps one walker (making one costs more than walking a small frame); one that saw a bad frame
    still holds its bytes and is dropped."""
    walk = getattr(_walkers, "unpacker", None) or msgpack.Unpacker(read_size=16 << 10, max_buffer_size=FAST_BYTES)
    _walkers.unpacker = None
    start = walk.tell()
    walk.feed(frame)
    try:
        walk.skip()
    except msgpack.OutOfData:
        raise FrameRefused("truncated", "the frame ends inside a value") from None
    except ValueError as exc:  # FormatError (0xc1), StackError (nested past msgpack's stack)
        raise FrameRefused("malformed", f"{type(exc).__name__}: {exc}") from None
    if walk.tell() - start != len(frame):
        raise FrameRefused("extra_data", "bytes after the end of the message")
    _walkers.unpacker = walk


_walkers = threading.local()


def scan(frame: bytes | memoryview, room: int) -> int:
    """The bytes ``frame``'s lists and maps will take once decoded; ``FrameRefused`` if the frame
    is cut short or has bytes left over (``truncated``, ``extra_data``), holds an extension type or
    0xc1 (``bad_type``, ``malformed``), more values than the walk allows (``bad_schema``), or its
    containers would take more than ``room`` (``oversized_decoded``)."""
    end, at, todo, charge, values = len(frame), 0, 1, 0, 0
    size, kind = _SIZE, _KIND
    while todo:
        if at >= end:
            raise FrameRefused("truncated", f"the frame ends with {todo} values still to come")
        b = frame[at]
        todo -= 1
        step = size[b]
        if step:
            at += step
            continue
        k = kind[b]
        width = k & 7
        if k & _FIX:
            n, at = b & 0x0F, at + 1
        elif width:
            n = int.from_bytes(frame[at + 1 : at + 1 + width], "big")
            at += 1 + width
        else:
            raise _bad(b)
        if k & _BIN:
            at += n
            continue
        if n > end - at:
            raise FrameRefused("truncated", f"a header declares {n} items with {end - at} bytes left")
        if n > MAX_ARRAY:
            raise FrameRefused("bad_schema", f"a list or map of {n} items; at most {MAX_ARRAY}")
        values += n
        if k & _MAP:
            todo += 2 * n
            charge += MAP_BYTES + ENTRY_BYTES * n
        else:
            todo += n
            charge += LIST_BYTES + ITEM_BYTES * n
        if values > MAX_VALUES:
            raise FrameRefused("bad_schema", f"more than {MAX_VALUES} values in one frame")
        if charge > room:
            raise _over(room)
    if at != end:
        raise FrameRefused(
            "truncated" if at > end else "extra_data",
            "the last value runs past the frame's end" if at > end else "bytes after the end of the message",
        )
    return charge


def _over(room: int) -> FrameRefused:
    return FrameRefused(
        "oversized_decoded", f"the frame would decode past the {room} bytes of decoded values left to its message"
    )


def _bad(b: int) -> FrameRefused:
    if b == 0xC1:
        return FrameRefused("malformed", "byte 0xc1 is not a msgpack value")
    return FrameRefused("bad_type", f"msgpack extension type (0x{b:02x}) is not accepted")
