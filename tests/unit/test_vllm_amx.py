"""A vLLM worker process holds the AMX permission before vLLM's bfloat16 CPU attention runs."""

import subprocess
import sys

import pytest
import torch

from tests.helpers.processes import ROOT

# arch_prctl(ARCH_GET_XCOMP_PERM): the extended states this process may use; bit 18 is XTILEDATA (AMX)
PROBE = """
import ctypes, sys
def tiles():
    perm = ctypes.c_uint64(0)
    ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(perm))
    return bool(perm.value >> 18 & 1)
import torch
before = tiles()
import flash.engine.vllm_weights
print(int(before), int(tiles()))
"""


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported() or sys.platform != "linux", reason="no AMX tiles")
def test_importing_the_worker_extension_grants_the_process_amx_tiles():
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        check=True,
    )
    assert out.stdout.split() == ["0", "1"]  # not granted by importing torch, granted by the extension


def test_without_amx_tiles_nothing_is_asked(monkeypatch):
    from flash.engine import vllm_weights

    asked = []
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: asked.append(1) or True)
    assert vllm_weights.request_amx() is False and asked == []
