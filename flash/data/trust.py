"""What a data path may be before anything in it is opened.

- **A named file** is a regular file (a symlink to one is followed: the user named it), never a
  FIFO, device or socket (opening a FIFO would block the driver) and never under ``/proc``,
  ``/sys`` or ``/dev``.
- **A ``save_to_disk`` directory** holds only regular files and directories: a symlink anywhere in
  it (to another dataset, to ``/proc/self/...``) or a non-regular file is refused before any file
  is read, and the files its ``state.json`` (and a ``DatasetDict``'s ``dataset_dict.json``) name
  must be plain relative names (``flash.checkpoint_trust``'s rule for a manifest: no ``..``, no
  absolute path) of regular files inside it. Its JSON files are read with a size bound.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from flash.checkpoint_trust import _plain_relative
from flash.errors import ConfigError

MAX_META_BYTES = 16 << 20  # state.json, dataset_info.json, dataset_dict.json
_PSEUDO = ("/proc", "/sys", "/dev")
_COPY = "copy the data in as regular files (e.g. cp -rL)"


def check_regular(p: Path, where: str) -> None:
    """ConfigError unless ``p`` (links followed) is a regular file outside the pseudo filesystems."""
    mode = os.stat(p).st_mode
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{where}: {p} is not a regular file (a FIFO, device or socket); name a data file")
    real = os.path.realpath(p)
    if any(real == root or real.startswith(root + "/") for root in _PSEUDO):
        raise ConfigError(f"{where}: {p} is {real}, not a data file; name a data file")


def only_regular(root: Path) -> str | None:
    """None when everything under ``root`` (links never followed) is a regular file or a
    directory; else the first entry that is not, as a reason."""
    for base, dirs, files in os.walk(root, followlinks=False):
        for name in sorted(dirs + files):
            full = Path(base) / name
            mode = os.lstat(full).st_mode
            rel = full.relative_to(root).as_posix()
            if stat.S_ISLNK(mode):
                return f"{rel} is a symlink"
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                return f"{rel} is not a regular file"
    return None


def read_meta(root: Path, name: str, where: str):
    """The JSON of ``root/name``: a regular file of at most ``MAX_META_BYTES``, else ConfigError."""
    f = root / name
    try:
        st = os.lstat(f)
    except FileNotFoundError:
        raise ConfigError(f"{where}: {root} has no {name}; save it again with Dataset.save_to_disk") from None
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_META_BYTES:
        raise ConfigError(
            f"{where}: {root}/{name} is not a regular file of at most {MAX_META_BYTES >> 20} MiB; "
            f"save it again with Dataset.save_to_disk"
        )
    try:
        return json.loads(f.read_bytes())
    except (ValueError, RecursionError) as exc:
        raise ConfigError(
            f"{where}: {root}/{name} is not valid JSON ({type(exc).__name__}); save it again with Dataset.save_to_disk"
        ) from None


def _inside(root: Path, name: object, what: str, where: str) -> Path:
    if not _plain_relative(name):
        raise ConfigError(
            f"{where}: {root} names {what} {str(name)[:80]!r}, which is not a plain name inside "
            f"the directory; save it again with Dataset.save_to_disk"
        )
    return root / str(name)


def saved_dataset(root: Path, where: str) -> Path:
    """The ``Dataset`` directory to load for ``root`` (a DatasetDict's ``train`` split), checked as
    the module docstring says; ConfigError naming the fix otherwise."""
    reason = only_regular(root)
    if reason is not None:
        raise ConfigError(
            f"{where}: {root}: {reason}; a save_to_disk directory must hold only its own regular files: {_COPY}"
        )
    if (root / "dataset_dict.json").exists() and not (root / "state.json").exists():
        splits = read_meta(root, "dataset_dict.json", where)
        splits = splits.get("splits") if isinstance(splits, dict) else None
        if not isinstance(splits, list):
            raise ConfigError(
                f"{where}: {root}/dataset_dict.json has no 'splits' list; save it again with DatasetDict.save_to_disk"
            )
        for split in splits:
            _inside(root, split, "split", where)
        if "train" not in splits:
            raise ConfigError(
                f"{where}: {root}: a DatasetDict without a 'train' split (it has "
                f"{sorted(map(str, splits))}); save the split you want with Dataset.save_to_disk"
            )
        root = root / "train"
    state = read_meta(root, "state.json", where)
    read_meta(root, "dataset_info.json", where)
    files = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(files, list) or not files:
        raise ConfigError(f"{where}: {root}/state.json lists no data files; save it again with Dataset.save_to_disk")
    for entry in files:
        f = _inside(root, entry.get("filename") if isinstance(entry, dict) else entry, "data file", where)
        if not f.is_file():
            raise ConfigError(
                f"{where}: {root}: data file {f.name} is missing; save it again with Dataset.save_to_disk"
            )
    return root
