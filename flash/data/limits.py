"""Bounds on a JSON row's size and nesting, checked before Arrow's JSON reader sees the row.

Arrow's reader recurses once per level of nesting: a row a few thousand levels deep ends the
process (a segfault, nothing to catch), and a few hundred levels end in a ``RecursionError``. So
each line of a JSONL file is scanned first, as bytes: a line over ``MAX_ROW_BYTES`` is skipped as
``too_large``; a line whose ``[``/``{`` count exceeds ``MAX_DEPTH`` has its true depth taken
outside strings (vectorized) and is skipped as ``too_deep`` when deeper. The scan streams the file
once (a long line is read in bounded chunks); when it skips rows, the kept lines are written once
to a copy in the datasets cache (keyed by the file's path, size and mtime) and that copy is read.

A ``.json`` file holding one document (an array of rows) cannot lose a row without being rewritten
as JSON, so one nested too deep is refused whole, with the fix (write it as JSONL).
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from pathlib import Path

from flash.errors import ConfigError
from flash.guards import json_depth

MAX_ROW_BYTES = 16 << 20  # one JSONL row (a prompt of millions of characters is no prompt)
MAX_DEPTH = 64  # nesting levels of one row, the row's own object included
_CHUNK = 1 << 20


def row_reason(line: bytes) -> str | None:
    """Why a JSONL line is skipped before the reader (``too_large``, ``too_deep``), or None."""
    if len(line) > MAX_ROW_BYTES:
        return "too_large"
    if line.count(b"[") + line.count(b"{") <= MAX_DEPTH:  # cannot nest deeper than it opens
        return None
    return "too_deep" if json_depth(line) > MAX_DEPTH else None


def _lines(f):
    """(line, reason) for each line of binary file ``f``; a line over ``MAX_ROW_BYTES`` comes back
    empty with reason ``too_large`` (the rest of it is read in chunks and dropped)."""
    while True:
        line = f.readline(MAX_ROW_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_ROW_BYTES and not line.endswith(b"\n"):
            while (rest := f.readline(_CHUNK)) and not rest.endswith(b"\n"):
                pass
            yield b"", "too_large"
            continue
        yield line, row_reason(line)


def _one_document(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return head.startswith(b"[")


def bounded_json(path: Path, where: str, skipped: Counter) -> Path:
    """``path``, or a copy of it without the rows over the bounds (each counted in ``skipped`` by
    reason); a one-document ``.json`` too deep is a ConfigError."""
    if _one_document(path):
        if path.stat().st_size > 0 and json_depth(path.read_bytes()) > MAX_DEPTH + 1:
            raise ConfigError(
                f"{where}: {path} nests deeper than {MAX_DEPTH} levels; write it as JSONL (one "
                f"row a line) so that rows too deep are skipped, or flatten them"
            )
        return path
    found: Counter = Counter()
    kept = 0
    with open(path, "rb") as f:
        for line, reason in _lines(f):
            if reason:
                found[reason] += 1
            elif line.strip():
                kept += 1
    if not found:
        return path
    if not kept:
        raise ConfigError(
            f"{where}: every row of {path} is over the bounds ({dict(found)}: rows of at most "
            f"{MAX_ROW_BYTES >> 20} MiB nested at most {MAX_DEPTH} levels); fix the file"
        )
    skipped.update(found)
    return _kept_copy(path)


def kept_paths(path: Path, suffix: str, *bounds: int) -> tuple[Path, Path]:
    """Where the rows of ``path`` within ``bounds`` are kept once in the datasets cache (a name from
    the file's path, size, mtime and the bounds), and the temporary file that is renamed to it."""
    from datasets import config

    st = path.stat()
    key = hashlib.sha256("\0".join(map(str, (path.resolve(), st.st_size, st.st_mtime_ns, *bounds))).encode())
    out = Path(config.HF_DATASETS_CACHE) / "flash_bounded" / f"{key.hexdigest()[:24]}{suffix}"
    out.parent.mkdir(parents=True, exist_ok=True)
    return out, out.with_suffix(f".{os.getpid()}.tmp")


def _kept_copy(path: Path) -> Path:
    """The lines of ``path`` within the bounds, written once to the datasets cache."""
    out, tmp = kept_paths(path, ".jsonl", MAX_ROW_BYTES, MAX_DEPTH)
    if out.is_file():
        return out
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        for line, reason in _lines(src):
            if reason is None:
                dst.write(line if line.endswith(b"\n") else line + b"\n")
    os.replace(tmp, out)
    return out
