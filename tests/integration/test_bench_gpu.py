"""``python -m bench.gpu``: its shape table is Qwen2.5's, its MFU arithmetic and peak table read as
documented, and ``--smoke`` runs every measure end to end on CPU (trainer, decode, colocated push)."""

import json
import subprocess
import sys

import pytest
import torch

from bench.gpu import build_model, mfu, n_params, peak_bf16


@pytest.mark.parametrize("shape, params", [("0.5b", 494_032_768), ("1.5b", 1_543_714_304)])
def test_shapes_have_the_published_parameter_counts(shape, params):
    with torch.device("meta"):
        assert n_params(build_model(shape)) == params  # Qwen2.5-0.5B / 1.5B, tied embeddings once


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.4e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989.4e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L40S", 362.05e12),
        ("cpu", None),
        ("Some Future GPU", None),
    ],
)
def test_peak_bf16_is_read_by_device_name(name, peak):
    assert peak_bf16(name) == peak


def test_mfu_is_six_flops_per_parameter_and_token_over_the_peak():
    assert mfu(10_000.0, 1_500_000_000, 989.4e12) == pytest.approx(6 * 1.5e13 / 989.4e12)
    assert mfu(10_000.0, 1_500_000_000, None) is None


@pytest.mark.timeout(300)
def test_smoke_runs_every_measure_on_cpu():
    out = subprocess.run([sys.executable, "-m", "bench.gpu", "--smoke"], capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["device"] == "cpu" and result["peak_bf16"] is None
    row = result["shapes"]["smoke"]
    assert row["trainer"]["tokens_per_s"] > 0 and row["trainer"]["mfu"] is None
    assert [d["seqs"] for d in row["decode"]] == [4, 8]
    assert all(d["engine_tokens_per_s"] > 0 and d["hf_generate_tokens_per_s"] > 0 for d in row["decode"])
    assert row["push"]["backend"] == "shm" and row["push"]["bytes"] > 0 and row["push"]["push_gb_per_s"] > 0
