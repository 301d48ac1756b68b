"""A checkpoint snapshot of GPU state lands in pinned host memory, equal to the live tensors, and
the next snapshot reuses its buffers (``flash.staging``)."""

from __future__ import annotations

import torch

from flash.staging import HostStager


def test_a_gpu_snapshot_is_pinned_host_memory_equal_to_the_live_state():
    live = {"w": torch.randn(256, 128, device="cuda"), "step": torch.tensor(3.0, device="cuda")}
    stager = HostStager()
    snap = stager.stage(live)
    assert snap["w"].device.type == "cpu" and snap["w"].is_pinned()
    assert torch.equal(snap["w"], live["w"].cpu()) and float(snap["step"]) == 3.0
    live["w"].add_(1.0)
    assert stager.stage(live)["w"] is snap["w"] and torch.equal(snap["w"], live["w"].cpu())
