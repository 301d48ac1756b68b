"""Bounds on Parquet and ``save_to_disk`` (Arrow) rows: the JSONL row bound, after decompression.

A Parquet page or an Arrow buffer can be compressed: a 9 KiB Parquet file holds a 256 MiB row, and
reading it with ``datasets`` decodes every row group whole (about 1 GB of memory and a 256 MiB
cache file for that one row). So a row's size is taken as Arrow would hold it, decoded
(``row_sizes``: string and binary values by their length, fixed-width values by their width,
anything else by its decoded bytes), and a row over ``flash.data.limits.MAX_ROW_BYTES`` is skipped
as ``too_large``, the outcome a JSONL line over it gets:

- **Parquet** (``bounded_parquet``): the footer's sizes come first. A row group whose decoded size
  (the larger of its uncompressed bytes and 8 bytes a value) averages over the bound per row holds
  at least one row over it; its rows are skipped without being decoded (a row that big has no
  neighbours worth decoding it for). Every other row group is read in batches of about
  ``BATCH_BYTES``, string columns as dictionaries (so a value shared by many rows is decoded once),
  and each row measured. When rows are skipped, the kept ones are written once to a Parquet copy
  in the datasets cache (keyed by the file's path, size and mtime) and that copy is read.
- **save_to_disk** (``bounded_saved``): ``datasets`` writes Arrow streams uncompressed and reads them
  memory-mapped, so measuring costs no memory; a stream with compressed buffers (which ``datasets``
  never writes, and which would be decompressed whole when loaded) is refused before it is opened.
  Rows over the bound are left out by an index (``Dataset.select``), not a copy.
"""

from __future__ import annotations

import os
import struct
from collections import Counter
from pathlib import Path

import numpy as np

from flash.data.limits import MAX_ROW_BYTES, kept_paths
from flash.errors import ConfigError

BATCH_BYTES = 4 << 20  # decoded bytes per batch a Parquet row group is read in (about)
MAX_BATCH_ROWS = 65536


def row_sizes(batch) -> np.ndarray:
    """Decoded bytes of each row of a ``RecordBatch``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    sizes = np.zeros(batch.num_rows, dtype=np.int64)
    for col in batch.columns:
        if pa.types.is_dictionary(col.type) and _is_text(col.type.value_type):
            lengths = pc.binary_length(col.dictionary)
            sizes += pc.fill_null(pc.take(lengths, col.indices), 0).to_numpy(zero_copy_only=False) + 4
        elif _is_text(col.type):
            sizes += pc.fill_null(pc.binary_length(col), 0).to_numpy(zero_copy_only=False) + 4
        elif pa.types.is_primitive(col.type) and col.type.bit_width >= 8:
            sizes += col.type.bit_width // 8
        elif col.nbytes <= BATCH_BYTES:  # a bound for every row at once
            sizes += col.nbytes
        else:
            sizes += np.fromiter((col.slice(i, 1).nbytes for i in range(len(col))), np.int64, len(col))
    return sizes


def _is_text(kind) -> bool:
    import pyarrow as pa

    return (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
    )


def _group_plan(meta, g: int) -> tuple[int, int]:
    """(rows, decoded bytes estimate) of row group ``g`` from the footer alone."""
    rg = meta.row_group(g)
    columns = [rg.column(j) for j in range(rg.num_columns)]
    uncompressed = sum(c.total_uncompressed_size for c in columns)
    values = sum(c.num_values for c in columns)
    return rg.num_rows, max(uncompressed, rg.total_byte_size, 8 * values)


def _batches(pf, g: int, rows: int, estimate: int):
    per_row = max(1, estimate // max(rows, 1))
    size = int(min(MAX_BATCH_ROWS, max(1, BATCH_BYTES // per_row)))
    return pf.iter_batches(batch_size=size, row_groups=[g], use_threads=False)


def _open_parquet(path: Path, where: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        probe = pq.ParquetFile(path)
        text = [f.name for f in probe.schema_arrow if _is_text(f.type)]
        return pq.ParquetFile(path, read_dictionary=text)
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise ConfigError(
            f"{where}: {path}: cannot read as parquet: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else ''}; fix the file"
        ) from None


def _too_large(pf) -> tuple[set[int], set[int]]:
    """(row groups skipped whole, other rows skipped), rows numbered across the file."""
    groups, rows = set(), set()
    base = 0
    for g in range(pf.metadata.num_row_groups):
        n, estimate = _group_plan(pf.metadata, g)
        if n and estimate // n > MAX_ROW_BYTES:
            groups.add(g)
        else:
            at = base
            for batch in _batches(pf, g, n, estimate):
                rows.update(at + int(i) for i in np.nonzero(row_sizes(batch) > MAX_ROW_BYTES)[0])
                at += batch.num_rows
        base += n
    return groups, rows


def bounded_parquet(path: Path, where: str, skipped: Counter) -> Path:
    """``path``, or a copy without its rows over ``MAX_ROW_BYTES`` (counted as ``too_large``)."""
    pf = _open_parquet(path, where)
    try:
        groups, rows = _too_large(pf)
    except Exception as exc:  # a page that does not decode: the parser's words, one line
        raise ConfigError(
            f"{where}: {path}: cannot read as parquet: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else ''}; fix the file"
        ) from None
    meta = pf.metadata
    count = len(rows) + sum(meta.row_group(g).num_rows for g in groups)
    if not count:
        return path
    if count >= meta.num_rows:
        raise ConfigError(
            f"{where}: every row of {path} is over {MAX_ROW_BYTES >> 20} MiB decoded ({count} too_large); fix the file"
        )
    skipped["too_large"] += count
    return _kept_parquet(path, pf, groups, rows)


def _kept_parquet(path: Path, pf, groups: set[int], rows: set[int]) -> Path:
    """The rows of ``path`` within the bound, written once to the datasets cache."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out, tmp = kept_paths(path, ".parquet", MAX_ROW_BYTES)
    if out.is_file():
        return out
    schema = pq.ParquetFile(path).schema_arrow
    base = 0
    with pq.ParquetWriter(tmp, schema) as writer:
        for g in range(pf.metadata.num_row_groups):
            n, estimate = _group_plan(pf.metadata, g)
            if g not in groups:
                at = base
                for batch in _batches(pf, g, n, estimate):
                    keep = np.array([at + i not in rows for i in range(batch.num_rows)])
                    writer.write_table(pa.Table.from_batches([batch.filter(pa.array(keep))]).cast(schema))
                    at += batch.num_rows
            base += n
    os.replace(tmp, out)
    return out


def _field(buf: bytes, table: int, i: int) -> int | None:
    """Where field ``i`` of the flatbuffer table at ``table`` is, or None when absent."""
    vtable = table - struct.unpack_from("<i", buf, table)[0]
    if 6 + 2 * i > struct.unpack_from("<H", buf, vtable)[0]:
        return None
    off = struct.unpack_from("<H", buf, vtable + 4 + 2 * i)[0]
    return table + off if off else None


def _compressed(metadata: bytes) -> bool:
    """Whether an Arrow IPC message's flatbuffer declares compressed body buffers (a record
    batch's ``compression`` field, or that of a dictionary batch's record batch)."""
    root = struct.unpack_from("<I", metadata, 0)[0]
    kind_at, header_at = _field(metadata, root, 1), _field(metadata, root, 2)
    kind = metadata[kind_at] if kind_at is not None else 0
    if header_at is None or kind not in (2, 3):  # 2: DictionaryBatch, 3: RecordBatch
        return False
    header = header_at + struct.unpack_from("<I", metadata, header_at)[0]
    if kind == 2:
        data_at = _field(metadata, header, 1)
        if data_at is None:
            return False
        header = data_at + struct.unpack_from("<I", metadata, data_at)[0]
    return _field(metadata, header, 3) is not None


def check_uncompressed(arrow_file: Path, where: str) -> None:
    """ConfigError unless every message of the Arrow stream ``arrow_file`` is uncompressed."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(arrow_file)) as source:
            for message in pa.ipc.MessageReader.open_stream(source):
                if _compressed(message.metadata.to_pybytes()):
                    raise ConfigError(
                        f"{where}: {arrow_file} holds compressed Arrow buffers, which datasets' "
                        "save_to_disk never writes; save it again with Dataset.save_to_disk"
                    )
    except (OSError, ValueError, struct.error, pa.ArrowException) as exc:
        raise ConfigError(
            f"{where}: {arrow_file.parent}: cannot load the save_to_disk directory: {arrow_file.name} "
            f"is not an Arrow stream ({type(exc).__name__}); save it again with Dataset.save_to_disk"
        ) from None


def bounded_saved(ds, where: str, skipped: Counter):
    """``ds`` (a loaded save_to_disk dataset) without its rows over ``MAX_ROW_BYTES``."""
    over: list[int] = []
    at = 0
    for batch in ds.data.table.to_batches(max_chunksize=MAX_BATCH_ROWS):
        over.extend(at + int(i) for i in np.nonzero(row_sizes(batch) > MAX_ROW_BYTES)[0])
        at += batch.num_rows
    if not over:
        return ds
    if len(over) >= len(ds):
        raise ConfigError(
            f"{where}: every row of the save_to_disk directory is over {MAX_ROW_BYTES >> 20} MiB "
            f"({len(over)} too_large); fix the data"
        )
    skipped["too_large"] += len(over)
    dropped = set(over)
    return ds.select([i for i in range(len(ds)) if i not in dropped])
