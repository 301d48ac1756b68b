"""JSON from outside, bounded before it is parsed: nesting depth and size.

Python's ``json`` parses and dumps recursively, so a value nested some thousand levels deep (a
few kilobytes of ``[``) ends in ``RecursionError`` wherever it is parsed, rendered or compared.
``check_json`` first counts the opening brackets (a memchr-speed pass): a text with no more of them
than the bound cannot nest deeper, and is not scanned; otherwise ``flash.guards.json_depth``
measures the nesting outside strings without parsing, never too low for text ``json`` accepts,
so a refusal never lets deep text through.
"""

from __future__ import annotations

import json
from typing import Any

from flash.guards import json_depth

MAX_JSON_DEPTH = 64  # arrays and objects; a JSON schema or a tool call's arguments nest far less


class TooDeep(ValueError):
    """JSON text that nests deeper, or is longer, than its bound (refused before parsing)."""


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
