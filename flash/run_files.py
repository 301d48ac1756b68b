"""Files flash writes in a run directory (and the outputs of ``flash replay``, ``flash plot`` and
``flash sweep``), opened so that a planted link never sends a write or a truncation elsewhere.

- ``refuse_links(root, what)``: a run, resume or sweep dir that is a symbolic link, or holds one
  anywhere below it (dangling or not), is refused before anything is written there, as is one
  holding a FIFO, socket or device, or a file with a second hard link (its other name may be
  outside). ``RunDirError`` is one line naming the entry and the fix.
- ``open_run_file(path, mode)``: ``open`` with ``O_NOFOLLOW`` (the kernel refuses a link as the
  last part of the path) and ``O_NONBLOCK`` (a FIFO cannot hold the open), checked by ``fstat`` to
  be a regular file with one link before it is truncated or written.
- ``write_run_text(path, text)``, and ``run_subdir(root, *parts)``: a folder inside a run dir, each
  part a plain name, made or checked to be a real directory (never a link to one).

Every run file flash reads back (``flash replay``, ``flash plot``, ``flash sweep``, ``flash plan``,
resume, a checkpoint's manifest and state) is read here too, bounded before it is parsed:

- ``read_jsonl(path, bounds)``: ``(line number, object)`` of each line, one line in memory at a
  time; ``load_jsonl`` the list of them (a ``.gz`` file is read through gzip, its decompressed
  bytes counted). ``read_json(path, bounds)``: one JSON document. ``parse_json(data, where,
  depth)``: bytes already read. ``check_yaml(text, where, depth)``: a YAML run file's nesting.
- ``ReadBounds``: the file's size (``fstat``, before a byte is read), one line's length (read with
  a limit: a sparse multi-GB file or one huge line costs at most the limit) and the JSON nesting
  depth (counted on the raw bytes before ``json.loads``, so a deep line never reaches the
  recursive parser). ``LOG_BOUNDS``, ``DOC_BOUNDS``, ``SCHEDULE_BOUNDS``, ``STATE_BOUNDS``: the
  bounds of each kind of run file. Past one: ``RunFileError``, one line naming the file, the line
  and the limit.
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import stat
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator

import numpy as np

from flash.errors import FlashError

_FLAGS = {"r": os.O_RDONLY, "w": os.O_WRONLY | os.O_CREAT, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND, "r+": os.O_RDWR}
FIX = "a run dir holds only the files flash wrote there: remove it, or pick another run_dir"


class RunDirError(FlashError):
    """A run dir (or a file flash writes) that is, or holds, a link or a special file."""


def _kind(st: os.stat_result) -> str | None:
    """What is wrong with an entry of a run dir, or None for a plain file or directory."""
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if stat.S_ISDIR(st.st_mode):
        return None
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file (a FIFO, socket or device)"
    return f"a file with {st.st_nlink} hard links" if st.st_nlink > 1 else None


def _refuse(path, kind: str, what: str, root=None) -> RunDirError:
    """The one line for ``path`` (inside ``root``, when given) being ``kind``."""
    target = f" to {os.readlink(path)[:120]!r}" if kind == "a symbolic link" else ""
    where = f"{what} {str(root)[:200]} holds {str(path)[:200]}," if root is not None else f"{what} {str(path)[:200]} is"
    return RunDirError(f"{where} {kind}{target}; {FIX}")


def refuse_links(root: str | Path, what: str = "run dir") -> None:
    """``RunDirError`` when ``root`` or anything below it is a link or a special file (see the
    module docstring); nothing is followed on the way. A ``root`` that does not exist passes."""
    try:
        kind = _kind(os.lstat(root))
    except (FileNotFoundError, NotADirectoryError):  # not there yet (making it says what is wrong)
        return
    if kind is not None:
        raise _refuse(root, kind, what)
    if not os.path.isdir(root):  # a plain file: nothing below it (making the folder says what is wrong)
        return
    for folder, dirs, files in os.walk(root, followlinks=False):
        for name in sorted(dirs + files):
            path = os.path.join(folder, name)
            try:
                kind = _kind(os.lstat(path))
            except FileNotFoundError:  # gone since it was listed
                continue
            if kind is not None:
                raise _refuse(path, kind, what, root)


def open_run_file(path: str | Path, mode: str = "w", **kwargs) -> IO:
    """``open(path, mode, **kwargs)`` that refuses a link, a special file or (for a mode that
    writes) a file with another hard link (``RunDirError``) before truncating: modes ``r``, ``w``,
    ``a``, ``r+`` (text or ``b``). Reading a hard-linked file changes nothing under its other name."""
    base = mode.replace("b", "")
    if base not in _FLAGS:
        raise ValueError(f"open_run_file: mode {mode!r} is not one of r, w, a, r+ (text or b)")
    flags = _FLAGS[base] | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError:  # ELOOP for a link; ENXIO for a FIFO no one reads
        try:
            kind = _kind(os.lstat(path))
        except OSError:
            kind = None
        if kind is not None:
            raise _refuse(path, kind, "run file") from None
        raise
    try:
        st = os.fstat(fd)
        kind = _kind(st) if base != "r" or not stat.S_ISREG(st.st_mode) else None
        if kind is not None:
            raise _refuse(path, kind, "run file")
        os.set_blocking(fd, True)
        if base == "w":
            os.ftruncate(fd, 0)
        return os.fdopen(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


def write_run_text(path: str | Path, text: str) -> None:
    """``Path(path).write_text(text)`` through ``open_run_file``."""
    with open_run_file(path, "w") as f:
        f.write(text)


def run_subdir(root: str | Path, *parts: str) -> Path:
    """``root/parts...``, each part a plain name, made where missing; ``RunDirError`` when one is a
    link or not a directory (a folder of the run dir that points elsewhere)."""
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    for part in parts:
        if not part or part in (".", "..") or "/" in part or "\0" in part:
            raise RunDirError(f"{part!r} cannot name a folder inside a run dir: use a plain name (no '/' or '..')")
        path = path / part
        try:
            path.mkdir()
        except FileExistsError:
            pass
        kind = _kind(os.lstat(path))
        if kind is not None or not path.is_dir():
            raise _refuse(path, kind or "a file, not a folder", "run dir")
    return path


# ---- reading a run file back: bounded before it is parsed ------------------------------------
@dataclass(frozen=True)
class ReadBounds:
    """What one run file may hold before it is parsed: its size in bytes (decompressed, for a
    ``.gz``), one line's length in bytes (its newline included) and its JSON nesting depth."""

    file_bytes: int
    line_bytes: int
    depth: int = 32


LOG_BOUNDS = ReadBounds(file_bytes=512 << 20, line_bytes=16 << 20)  # metrics, timeline, eval, ledger, events
DOC_BOUNDS = ReadBounds(file_bytes=64 << 20, line_bytes=64 << 20)  # summary.json, sweep_point.json, config.yaml
SCHEDULE_BOUNDS = ReadBounds(file_bytes=64 << 30, line_bytes=256 << 20)  # one step's batch a line, read one at a time
STATE_BOUNDS = ReadBounds(file_bytes=4 << 30, line_bytes=4 << 30)  # a checkpoint's state.json (its buffer)

_NOT_BRACKET = bytes(b for b in range(256) if b not in b'"[]{}')
_STEP = np.zeros(256, np.int32)  # +1 where an array or object opens, -1 where one closes
_STEP[[ord("["), ord("{")]], _STEP[[ord("]"), ord("}")]] = 1, -1
_CHUNK = 1 << 22  # bytes counted at once (bounds the count's own memory)


class RunFileError(FlashError, ValueError):
    """A run file past its ``ReadBounds``, or not JSON that flash writes: one line naming the file,
    the line and the limit."""


def _size(n: int) -> str:
    return f"{n >> 30} GiB" if n >= 1 << 30 else f"{n >> 20} MiB" if n >= 1 << 20 else f"{n} bytes"


def nesting_depth(data: bytes) -> int:
    """How deep the JSON text ``data`` nests arrays and objects (brackets in strings not counted),
    counted on the bytes in vectorised chunks -- never by the recursive parser. Escaped
    backslashes and quotes are dropped first, then everything but quotes and brackets."""
    data = data.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_BRACKET)
    deepest = level = 0
    inside = 0  # 1 while a string is open at a chunk's start
    for start in range(0, len(data), _CHUNK):
        chunk = np.frombuffer(data, np.uint8, count=min(_CHUNK, len(data) - start), offset=start)
        quotes = np.cumsum(chunk == ord('"'), dtype=np.int64) + inside
        steps = np.where(quotes % 2 == 1, 0, _STEP[chunk])
        levels = np.cumsum(steps, dtype=np.int64) + level
        deepest, level, inside = max(deepest, int(levels.max())), int(levels[-1]), int(quotes[-1] % 2)
    return deepest


def parse_json(data: bytes, where: str, depth: int = LOG_BOUNDS.depth) -> dict:
    """``data`` (one line or one document of a run file, named ``where``) as a JSON object, its
    nesting checked before it is parsed; ``RunFileError`` when it is deeper, not JSON or not an
    object."""
    if nesting_depth(data) > depth:
        raise RunFileError(
            f"{where}: JSON nested more than {depth} deep (the limit for a run file); "
            "flash wrote no such line: pass a run dir flash wrote"
        )
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise RunFileError(
            f"{where}: not JSON ({type(exc).__name__}: {str(exc)[:100]}); the file is damaged: "
            "pass a run dir flash wrote"
        ) from None
    if not isinstance(value, dict):
        raise RunFileError(f"{where}: a {type(value).__name__}, not a JSON object (what flash writes there)")
    return value


def _checked_size(path: str | Path, size: int, bounds: ReadBounds) -> None:
    if size > bounds.file_bytes:
        raise RunFileError(
            f"{path}: {size} bytes, over the {_size(bounds.file_bytes)} limit for this run file; "
            "flash wrote no such file: pass a run dir flash wrote"
        )


def read_jsonl(path: str | Path, bounds: ReadBounds = LOG_BOUNDS) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` for each non-blank line of a JSON-lines run file (gzipped when
    its name ends ``.gz``), one line in memory at a time; ``RunFileError`` at the first line or
    byte past ``bounds``."""
    with open_run_file(path, "rb") as raw:
        _checked_size(path, os.fstat(raw.fileno()).st_size, bounds)
        f = gzip.GzipFile(fileobj=raw) if str(path).endswith(".gz") else raw
        total = 0
        for n in itertools.count(1):
            try:
                line = f.readline(bounds.line_bytes + 1)
            except (OSError, EOFError, zlib.error) as exc:
                raise RunFileError(f"{path}:{n}: not gzip that flash wrote ({str(exc)[:100]})") from None
            if not line:
                return
            total += len(line)
            if len(line) > bounds.line_bytes:
                raise RunFileError(
                    f"{path}:{n}: a line over {_size(bounds.line_bytes)} (the limit for this run "
                    "file); flash wrote no such line: pass a run dir flash wrote"
                )
            _checked_size(path, total, bounds)
            if line.strip():
                yield n, parse_json(line, f"{path}:{n}", bounds.depth)


def load_jsonl(path: str | Path, bounds: ReadBounds = LOG_BOUNDS) -> list[dict]:
    """Every line of ``read_jsonl``; [] when there is no such file (a link of that name is refused)."""
    if not os.path.lexists(path):
        return []
    return [line for _, line in read_jsonl(path, bounds)]


def read_json(path: str | Path, bounds: ReadBounds = DOC_BOUNDS, default: dict | None = None) -> dict:
    """A run file holding one JSON object, read within ``bounds``; ``default`` (when given) where
    there is no such file."""
    if default is not None and not os.path.lexists(path):
        return default
    with open_run_file(path, "rb") as f:
        _checked_size(path, os.fstat(f.fileno()).st_size, bounds)
        data = f.read(bounds.file_bytes + 1)
    _checked_size(path, len(data), bounds)
    return parse_json(data, str(path), bounds.depth)


def read_text(path: str | Path, bounds: ReadBounds = DOC_BOUNDS) -> str:
    """A text run file (``config.yaml``), read within ``bounds``' size; ``RunFileError`` past it
    or for bytes that are not UTF-8."""
    with open_run_file(path, "rb") as f:
        _checked_size(path, os.fstat(f.fileno()).st_size, bounds)
        data = f.read(bounds.file_bytes + 1)
    _checked_size(path, len(data), bounds)
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise RunFileError(f"{path}: not UTF-8 text (what flash writes there)") from None


def check_yaml(text: str, where: str, depth: int = DOC_BOUNDS.depth) -> None:
    """``RunFileError`` when the YAML ``text`` nests more than ``depth`` deep or holds an alias
    (flash writes neither; an alias can multiply a small file's size when it is built), read as
    the parser's events, before anything is composed."""
    import yaml

    level = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent):
                raise RunFileError(f"{where}: a YAML alias (*{str(event.anchor)[:40]}); flash writes none there")
            level += isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent))
            level -= isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent))
            if level > depth:
                raise RunFileError(f"{where}: YAML nested more than {depth} deep (the limit for a run file)")
    except yaml.YAMLError as exc:
        raise RunFileError(f"{where}: not YAML ({str(exc).splitlines()[0][:160]})") from None
