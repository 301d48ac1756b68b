"""Parquet and save_to_disk rows are held to the JSONL row bound after decompression
(flash.data.arrow_limits): a row over ``MAX_ROW_BYTES`` decoded is skipped as ``too_large`` and
counted, a row group whose rows average over it is never decoded, a value shared by many rows is
measured per row (no false refusal), and an Arrow stream with compressed buffers is refused."""

from __future__ import annotations

import glob
import os
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flash.data import arrow_limits
from flash.data.arrow_limits import row_sizes
from flash.data.files import datasets_module, open_rows
from flash.data.limits import MAX_ROW_BYTES
from flash.errors import ConfigError

BIG = "a" * (MAX_ROW_BYTES + (1 << 20))  # 17 MiB: over the bound by 1 MiB


def rows(n: int, big_at: tuple[int, ...] = ()) -> dict:
    return {
        "question": [BIG if i in big_at else f"what is {i} plus 1?" for i in range(n)],
        "answer": [f"#### {i + 1}" for i in range(n)],
        "id": list(range(n)),
    }


@pytest.fixture(scope="module", autouse=True)
def readers_loaded(tmp_path_factory):
    """One small file read first, so the module's first test is not charged the one-off import of
    the datasets library's Parquet builder against the unit tier's CPU budget."""
    path = tmp_path_factory.mktemp("warm") / "small.parquet"
    pq.write_table(pa.table(rows(2)), path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets_module().config, "HF_DATASETS_CACHE", str(path.parent / "cache"))
        open_rows([str(path)], skipped=Counter())


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets_module().config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))


def test_a_compressed_row_over_the_bound_is_skipped_without_being_decoded(tmp_path, monkeypatch):
    path = tmp_path / "bomb.parquet"
    pq.write_table(pa.table(rows(4, big_at=(1,))), path, compression="zstd", row_group_size=1)
    assert os.path.getsize(path) < 64 << 10  # 17 MiB of row in a few KiB of file
    decoded = []
    real = arrow_limits._batches
    monkeypatch.setattr(arrow_limits, "_batches", lambda pf, g, *a: decoded.append(g) or real(pf, g, *a))
    skipped = Counter()
    ds = open_rows([str(path)], skipped=skipped)
    assert skipped == Counter({"too_large": 1}) and ds["id"] == [0, 2, 3]
    assert 1 not in decoded  # the row group was refused from the footer's sizes
    assert sum(len(q) for q in ds["question"]) < 100


def test_a_row_over_the_bound_among_many_is_found_by_its_decoded_size(tmp_path):
    path = tmp_path / "mixed.parquet"
    pq.write_table(pa.table(rows(300, big_at=(7, 250))), path, compression="zstd")  # one row group
    assert pq.ParquetFile(path).metadata.num_row_groups == 1
    skipped = Counter()
    ds = open_rows([str(path)], skipped=skipped)
    assert skipped == Counter({"too_large": 2}) and ds["id"] == [i for i in range(300) if i not in (7, 250)]
    again = Counter()
    assert open_rows([str(path)], skipped=again)["id"] == ds["id"] and again == skipped  # the cached copy


def test_a_value_shared_by_many_rows_counts_once_per_row(tmp_path):
    shared = "b" * (1 << 20)
    n = MAX_ROW_BYTES // len(shared) + 1  # together over the row bound; each row far under it
    table = pa.table({"question": [shared] * n, "answer": ["#### 1"] * n})
    path = tmp_path / "shared.parquet"
    pq.write_table(table, path)  # dictionary-encoded: the value is stored once
    skipped = Counter()
    assert len(open_rows([str(path)], skipped=skipped)) == n and not skipped
    batch = next(arrow_limits._open_parquet(path, "data.train").iter_batches())
    assert pa.types.is_dictionary(batch.schema.field("question").type)
    assert set(row_sizes(batch)) == {(1 << 20) + 4 + 6 + 4}


def test_row_sizes_of_each_kind_of_column():
    batch = pa.record_batch(
        {
            "s": ["ab", None, "c" * 10],
            "i": [1, 2, 3],
            "f": [0.5, 1.5, None],
            "l": [[1, 2], [], [3]],
            "b": [True, False, True],
        }
    )
    sizes = row_sizes(batch)
    nested = batch.column("l").nbytes + batch.column("b").nbytes
    assert list(sizes) == [2 + 4 + 8 + 8 + nested, 0 + 4 + 8 + 8 + nested, 10 + 4 + 8 + 8 + nested]


def test_a_parquet_file_of_only_rows_over_the_bound_is_one_line(tmp_path):
    path = tmp_path / "all.parquet"
    pq.write_table(pa.table(rows(2, big_at=(0, 1))), path, compression="zstd", row_group_size=1)
    with pytest.raises(ConfigError, match=r"every row of .* is over 16 MiB decoded \(2 too_large\); fix the file"):
        open_rows([str(path)])
    (tmp_path / "bad.parquet").write_bytes(b"PAR1" + b"\0" * 64)
    with pytest.raises(ConfigError, match="bad.parquet: cannot read as parquet: ") as err:
        open_rows([str(tmp_path / "bad.parquet")])
    assert "\n" not in str(err.value)


def test_a_save_to_disk_row_over_the_bound_is_left_out_by_an_index(tmp_path):
    datasets = datasets_module()
    datasets.Dataset.from_dict(rows(5, big_at=(3,))).save_to_disk(str(tmp_path / "saved"))
    skipped = Counter()
    ds = open_rows([str(tmp_path / "saved")], skipped=skipped)
    assert skipped == Counter({"too_large": 1}) and ds["id"] == [0, 1, 2, 4]
    assert not (tmp_path / "cache").exists()  # no copy written: an index over the memory map


def test_a_save_to_disk_stream_with_compressed_buffers_is_refused_before_loading(tmp_path):
    datasets = datasets_module()
    datasets.Dataset.from_dict(rows(3, big_at=(1,))).save_to_disk(str(tmp_path / "saved"))
    arrow = glob.glob(str(tmp_path / "saved" / "*.arrow"))[0]
    with pa.memory_map(arrow) as source:
        table = pa.ipc.open_stream(source).read_all()
    os.remove(arrow)
    with (
        pa.OSFile(arrow, "wb") as sink,
        pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer,
    ):
        writer.write_table(table)
    assert os.path.getsize(arrow) < 64 << 10
    with pytest.raises(
        ConfigError,
        match="holds compressed Arrow buffers, which datasets' save_to_disk never "
        "writes; save it again with Dataset.save_to_disk",
    ) as err:
        open_rows([str(tmp_path / "saved")])
    assert "\n" not in str(err.value)
