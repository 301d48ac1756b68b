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
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import IO

from flash.errors import FlashError

_FLAGS = {"r": os.O_RDONLY, "w": os.O_WRONLY | os.O_CREAT, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
          "r+": os.O_RDWR}
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
    """``open(path, mode, **kwargs)`` that refuses a link, a special file or a file with another
    hard link (``RunDirError``) before truncating: modes ``r``, ``w``, ``a``, ``r+`` (text or
    ``b``)."""
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
        kind = _kind(os.fstat(fd))
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
