"""A GGUF file's metadata, bounded before a GGUF reader sees it.

The ``gguf`` package's reader (which transformers loads GGUF with) memory-maps the file and makes a
numpy view for every array entry: a few bytes of header claiming an array of millions of entries
cost gigabytes of Python objects before anything is checked. ``check_metadata`` walks the header,
the key-value pairs and the tensor infos itself over a memory map, reading only the lengths it
needs (string contents are skipped), and refuses the file in one line (``ConfigError``) at the first
bound passed:

- ``MAX_KV`` key-value pairs and ``MAX_TENSORS`` tensor infos;
- ``MAX_ARRAY`` entries in one array and ``MAX_ITEMS`` array entries in all (nested arrays at most
  ``MAX_NESTING`` deep);
- ``MAX_STRING`` bytes in one string (a key, a value, an array entry, a tensor name);
- ``MAX_METADATA`` bytes of header, pairs and tensor infos together, which must lie inside the file.

The bounds are far above real models' (a 262,144-token vocabulary, a few dozen keys, a few
thousand tensors).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from flash.errors import ConfigError

MAX_KV = 4096
MAX_TENSORS = 1 << 16
MAX_ARRAY = 1 << 20  # entries of one array (tokenizer.ggml.tokens, .merges, .scores, ...)
MAX_ITEMS = 1 << 21  # array entries in all
MAX_STRING = 1 << 20  # bytes of one string
MAX_METADATA = 64 << 20  # bytes of header, key-value pairs and tensor infos
MAX_NESTING = 2  # arrays of arrays
MAX_DIMS = 8
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
_STRING, _ARRAY = 8, 9


class _Walk:
    """A cursor over the file's memory map: every length checked against the bounds and the file
    before it is used (nothing is read past what the checks need)."""

    def __init__(self, data, path: Path) -> None:
        self.data, self.path = data, path
        self.end = min(len(data), MAX_METADATA)
        self.pos = 0
        self.items = 0
        self.order = "<"

    def fail(self, what: str) -> ConfigError:
        return ConfigError(
            f"model.gguf: {self.path}: {what}; the file is not a model's GGUF (re-export it, or name another file)"
        )

    def skip(self, n: int) -> int:
        """Move past ``n`` bytes; the position they start at."""
        start, self.pos = self.pos, self.pos + n
        if self.pos > self.end:
            if self.pos > len(self.data):
                raise self.fail("its metadata runs past the end of the file")
            raise self.fail(f"its metadata is over {MAX_METADATA >> 20} MiB (the bound)")
        return start

    def uint(self, width: int) -> int:
        return struct.unpack_from(self.order + ("I" if width == 4 else "Q"), self.data, self.skip(width))[0]

    def string(self, what: str) -> str:
        n = self.uint(8)
        if n > MAX_STRING:
            raise self.fail(f"{what} is a string of {n:,} bytes, over the bound of {MAX_STRING:,}")
        start = self.skip(n)
        return bytes(self.data[start : start + min(n, 200)]).decode("utf-8", "replace")

    def strings(self, n: int, key: str) -> None:
        """Move past ``n`` strings (an array's), their lengths checked."""
        length = struct.Struct(self.order + "Q").unpack_from
        data, pos, end = self.data, self.pos, self.end
        for _ in range(n):
            if pos + 8 > end:
                break
            size = length(data, pos)[0]
            if size > MAX_STRING:
                raise self.fail(f"an entry of {key!r} is a string of {size:,} bytes, over the bound of {MAX_STRING:,}")
            pos += 8 + size
        else:
            self.skip(pos - self.pos)
            return
        self.skip(end + 1 - self.pos)  # past the end: the error that says which end

    def value(self, kind: int, key: str, depth: int = 0) -> None:
        if kind in _FIXED:
            self.skip(_FIXED[kind])
        elif kind == _STRING:
            self.string(f"the value of {key!r}")
        elif kind == _ARRAY:
            self.array(key, depth + 1)
        else:
            raise self.fail(f"{key!r} has the unknown value type {kind}")

    def array(self, key: str, depth: int) -> None:
        if depth > MAX_NESTING:
            raise self.fail(f"{key!r} nests arrays over {MAX_NESTING} deep (the bound)")
        kind, n = self.uint(4), self.uint(8)
        if n > MAX_ARRAY:
            raise self.fail(f"the array {key!r} has {n:,} entries, over the bound of {MAX_ARRAY:,}")
        self.items += n
        if self.items > MAX_ITEMS:
            raise self.fail(f"its arrays hold over {MAX_ITEMS:,} entries in all (the bound)")
        if kind in _FIXED:
            self.skip(_FIXED[kind] * n)
        elif kind == _STRING:
            self.strings(n, key)
        else:
            for _ in range(n):
                self.value(kind, key, depth)


def _header(walk: _Walk) -> tuple[int, int]:
    """(tensor count, key-value count) after the magic and the version (either byte order)."""
    start = walk.skip(8)
    if bytes(walk.data[start : start + 4]) != b"GGUF":
        raise walk.fail("it does not start with the GGUF magic")
    raw = bytes(walk.data[start + 4 : start + 8])
    version = struct.unpack("<I", raw)[0]
    if version & 0xFFFF == 0:
        walk.order, version = ">", struct.unpack(">I", raw)[0]
    if version not in (2, 3):
        raise walk.fail(f"GGUF version {version} is not one this reader knows (2 or 3)")
    tensors, kvs = walk.uint(8), walk.uint(8)
    if kvs > MAX_KV:
        raise walk.fail(f"it claims {kvs:,} key-value pairs, over the bound of {MAX_KV:,}")
    if tensors > MAX_TENSORS:
        raise walk.fail(f"it claims {tensors:,} tensors, over the bound of {MAX_TENSORS:,}")
    return tensors, kvs


def check_metadata(path: str | os.PathLike) -> None:
    """ConfigError (one line) unless the GGUF file's metadata is within the module's bounds."""
    import mmap

    path = Path(path)
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < 24:
            raise ConfigError(f"model.gguf: {path}: too short for a GGUF header; name a model's GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            _walk(_Walk(data, path))


def _walk(walk: _Walk) -> None:
    tensors, kvs = _header(walk)
    for _ in range(kvs):
        key = walk.string("a key")
        walk.value(walk.uint(4), key)
    for _ in range(tensors):
        name = walk.string("a tensor name")
        dims = walk.uint(4)
        if dims > MAX_DIMS:
            raise walk.fail(f"the tensor {name!r} claims {dims} dimensions, over {MAX_DIMS}")
        walk.skip(8 * dims + 4 + 8)
