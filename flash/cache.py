"""Build-once directories under the cache (warm starts, converted GGUF models).

Several processes may ask for the same directory at once (a sweep's points, tests): each builds in
a private temporary directory and renames it into place, which is atomic on one filesystem, so a
reader sees either nothing or a complete directory (its ``marker`` file written last by ``build``).
The loser of a race discards its copy.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def default_cache_dir(cache_dir: str | None = None) -> str:
    """The cache root: ``cache_dir`` (the config's ``cache_dir``) when set, else ``$FLASH_CACHE``,
    else ``~/.cache/flash``."""
    return cache_dir or os.environ.get("FLASH_CACHE") or str(Path.home() / ".cache" / "flash")


def build_once(final: str, marker: str, build: Callable[[str], T]) -> T | None:
    """Run ``build(tmp_dir)`` and move its result to ``final``, unless ``final/marker`` exists.

    Returns what ``build`` returned, or None when the directory was already there (or another
    process finished it first)."""
    if os.path.exists(os.path.join(final, marker)):
        return None
    parent = os.path.dirname(final) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".tmp-{os.path.basename(final)}-", dir=parent)
    try:
        result = build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.exists(os.path.join(final, marker)):
                raise  # not a lost race with another writer: a real error
            shutil.rmtree(tmp, ignore_errors=True)
            return None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result
