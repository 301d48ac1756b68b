"""Local dataset files as one memory-mapped table, through Hugging Face ``datasets``.

``open_rows(paths)`` reads JSONL/JSON, CSV, Parquet and directories written by
``Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk``: its ``train`` split) and concatenates
them. Each path is checked before it is opened (``flash.data.trust``: regular files only; a
save_to_disk directory without links, naming only files inside it); JSON rows are bounded in
size and nesting before Arrow reads them (``flash.data.limits``), and Parquet and save_to_disk rows
in decoded size (``flash.data.arrow_limits``): rows over the bounds are skipped and counted. Rows stay in Arrow files on disk (``datasets`` memory-maps them), so a million-row Parquet
file costs a few MB of Python memory, not a list of a million dicts.

Only local paths: flash never downloads at run time, so a name that is not a file (a hub id such
as ``openai/gsm8k``) is an error saying how to download it first. A file's format comes from its
suffix (``.jsonl.gz`` is decompressed first, ``flash.data.sources``); anything else is an
error naming the suffixes known. ``pkg:DIST/PATH`` names a file an installed package ships.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from pathlib import Path

from flash.data.arrow_limits import bounded_parquet, bounded_saved, check_uncompressed
from flash.data.limits import bounded_json
from flash.data.sources import gunzipped, local_path
from flash.data.trust import check_regular, read_meta, saved_dataset
from flash.errors import ConfigError

FORMATS = {
    ".jsonl": "json",
    ".jsonl.gz": "json",
    ".json": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
}


def file_format(p: Path) -> str | None:
    """The reader for ``p`` by its suffix (``.jsonl.gz`` included), or None."""
    name = p.name.lower()
    return next((kind for suffix, kind in FORMATS.items() if name.endswith(suffix)), None)


_HUB_HINT = (
    'flash reads local files only: download it first, e.g. python -c "import datasets; '
    "datasets.load_dataset('{name}', split='train').to_json('data.jsonl')\", then name data.jsonl"
)


def datasets_module():
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never reach the hub
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def check_path(path: str, where: str = "data.train") -> Path:
    """The local file or ``save_to_disk`` directory ``path``, or a one-line ConfigError."""
    p = local_path(path, where)
    if p.is_dir():
        if not (p / "dataset_info.json").exists() and not (p / "dataset_dict.json").exists():
            raise ConfigError(
                f"{where}: {path} is a directory but not one written by datasets' save_to_disk "
                f"(no dataset_info.json); name its files instead"
            )
        return p
    if p.exists() and not p.is_dir():
        if file_format(p) is None:
            raise ConfigError(
                f"{where}: {path}: unknown file type {p.suffix!r}; use one of "
                f"{sorted(FORMATS)} or a save_to_disk directory"
            )
        check_regular(p, where)
        return p
    if not p.suffix and "/" in path and not path.startswith((".", "/", "~")) and path.count("/") == 1:
        raise ConfigError(f"{where}: {path!r} is not a local file; {_HUB_HINT.format(name=path)}")
    raise ConfigError(f"{where}: no such file or directory: {path}")


def _load_one(p: Path, where: str, skipped: Counter):
    ds = datasets_module()
    if p.is_dir():
        root = saved_dataset(p, where)
        for entry in read_meta(root, "state.json", where)["_data_files"]:
            check_uncompressed(root / entry["filename"], where)
        try:
            saved = ds.Dataset.load_from_disk(str(root))
        except (OSError, ValueError, KeyError, TypeError) as exc:  # arrow files that do not read (or nest too deep)
            raise ConfigError(
                f"{where}: {p}: cannot load the save_to_disk directory: {_parser_words(exc)}; "
                "save it again with Dataset.save_to_disk"
            ) from None
        return bounded_saved(saved, where, skipped)
    if p.stat().st_size == 0:
        raise ConfigError(f"{p} is empty: a data file needs at least one row")
    kind = file_format(p)
    source = gunzipped(p, where) if p.name.lower().endswith(".gz") else p
    if kind == "json":
        source = bounded_json(source, where, skipped)
    elif kind == "parquet":
        source = bounded_parquet(p, where, skipped)
    level = ds.logging.get_verbosity()
    ds.logging.set_verbosity(ds.logging.CRITICAL)  # its own 'Failed to load JSON' line: the error below says it
    try:
        return ds.load_dataset(kind, data_files=[str(source)], split="train")
    except Exception as exc:  # a parser error from pyarrow/pandas: name the file, not the stack
        raise ConfigError(f"{p}: cannot read as {kind}: {_parser_words(exc)}; fix the file") from None
    finally:
        ds.logging.set_verbosity(level)


def _parser_words(exc: Exception) -> str:
    """The parser's own message (which row, what is wrong): ``datasets`` wraps it in a
    DatasetGenerationError that says only 'An error occurred while generating the dataset'."""
    if type(exc).__name__ == "DatasetGenerationError" and exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc).splitlines()[0][:300] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"


def open_rows(paths: tuple[str, ...] | list[str], where: str = "data.train", skipped: Counter | None = None):
    """One ``datasets.Dataset`` over ``paths`` in order (their columns must agree). Rows skipped
    before the reader (``flash.data.limits``) are counted by reason in ``skipped``."""
    if not paths:
        raise ConfigError(f"{where} is empty: name at least one file")
    skipped = Counter() if skipped is None else skipped
    parts = [_load_one(check_path(p, where), where, skipped) for p in paths]
    if len(parts) == 1:
        return parts[0]
    first = set(parts[0].column_names)
    for path, part in zip(paths[1:], parts[1:]):
        if set(part.column_names) != first:
            raise ConfigError(
                f"{where}: {path} has columns {sorted(part.column_names)} but {paths[0]} has "
                f"{sorted(first)}; the files of one set must share their columns"
            )
    try:
        return datasets_module().concatenate_datasets(parts)
    except ValueError as exc:  # same names, incompatible types (e.g. a string column vs an int one)
        raise ConfigError(f"{where}: the files' columns have different types: {exc}") from None


def content_hash(paths: tuple[str, ...] | list[str]) -> str:
    """A digest of the files' bytes (every file of a directory, in name order): the identity of the
    data for caches, so the same rows at another path share a warm start."""
    h = hashlib.sha256()
    for path in paths:
        p = local_path(path)
        files = sorted(f for f in p.rglob("*") if f.is_file() and not f.is_symlink()) if p.is_dir() else [p]
        for f in files:
            h.update(f.name.encode() + b"\0")
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()[:16]
