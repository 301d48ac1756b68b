"""JSON from outside, bounded before it is parsed: nesting depth and size.

Python's ``json`` parses and dumps recursively, so a value nested some thousand levels deep (a
few kilobytes of ``[``) ends in ``RecursionError`` wherever it is parsed, rendered or compared.
``json_depth`` measures the nesting without parsing and without recursion, in vectorised passes over
the bytes: escaped backslashes and quotes are dropped, then every byte but quotes and brackets,
then what lies inside strings (every other piece between quotes), and the depth is the highest
running sum of ``+1`` per opening and ``-1`` per closing bracket. Brackets inside strings never
count. ``check_json`` first counts the opening brackets (a memchr-speed pass): a text with no
more of them than the bound cannot nest deeper, and is not scanned. On malformed text the measure may be too high (an unclosed string's brackets count), never
too low for text ``json`` would accept, so a refusal never lets deep text through.
"""

from __future__ import annotations

import json
from itertools import accumulate
from typing import Any

import numpy as np

MAX_JSON_DEPTH = 64  # arrays and objects; a JSON schema or a tool call's arguments nest far less
_DELTA = np.zeros(256, np.int32)
_DELTA[[ord("["), ord("{")]] = 1
_DELTA[[ord("]"), ord("}")]] = -1
_STEP = _DELTA.tolist()
_NOT_STRUCTURE = bytes(b for b in range(256) if not _DELTA[b] and b != ord('"'))


class TooDeep(ValueError):
    """JSON text that nests deeper, or is longer, than its bound (refused before parsing)."""


def json_depth(text: str | bytes) -> int:
    """The deepest nesting of arrays and objects in JSON ``text`` (0 for a scalar), not parsing it."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    data = data.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    brackets = b"".join(data.split(b'"')[::2])
    if len(brackets) < 1024:  # a few brackets: a plain running sum is quicker than numpy's set-up
        return max(0, max(accumulate(map(_STEP.__getitem__, brackets)), default=0))
    return max(0, int(np.cumsum(_DELTA[np.frombuffer(brackets, np.uint8)]).max()))


def check_json(text: str | bytes, max_depth: int = MAX_JSON_DEPTH, max_bytes: int | None = None) -> None:
    """Raise ``TooDeep`` (one line naming the bound) when ``text`` is over either bound."""
    if max_bytes is not None and len(text) > max_bytes:
        raise TooDeep(f"the JSON is over {max_bytes} bytes")
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if data.count(b"[") + data.count(b"{") <= max_depth:  # too few openings to nest deeper: no scan
        return
    depth = json_depth(data)
    if depth > max_depth:
        raise TooDeep(f"the JSON nests {depth} levels deep, over the bound of {max_depth}: flatten it")


def loads(text: str | bytes, max_depth: int = MAX_JSON_DEPTH, max_bytes: int | None = None, **kw: Any) -> Any:
    """``json.loads`` behind ``check_json``; ``TooDeep`` and ``json``'s ValueError are both ValueErrors."""
    check_json(text, max_depth, max_bytes)
    return json.loads(text, **kw)
