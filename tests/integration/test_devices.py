"""Devices and precision (flash.devices): which device a role's actor runs on, and the dtype names.

The mapping is a pure function of what Ray gave the actor and whether CUDA works, pinned for every
case; in a Ray actor given one of two simulated GPUs (``ray.init(num_gpus=2)``, no CUDA on this
machine) it is the CPU, as it is for an actor given none.
"""

import pytest
import ray
import torch

from flash.devices import actor_device, autocast, autocast_dtype, device_for, torch_dtype


def test_device_for_is_the_current_cuda_device_only_with_gpus_and_cuda():
    assert device_for([], cuda_available=True) == torch.device("cpu")  # no GPU for this actor
    assert device_for(["0"], cuda_available=False) == torch.device("cpu")  # simulated GPUs
    assert device_for([], cuda_available=False) == torch.device("cpu")
    # Ray exposes the actor's GPU (physical 3) as the visible device 0: the local index is used
    assert device_for(["3"], cuda_available=True) == torch.device("cuda", 0)
    assert device_for(["3", "5"], cuda_available=True, current=1) == torch.device("cuda", 1)


def test_outside_ray_the_device_is_the_cpu():
    assert actor_device() == torch.device("cpu")


@pytest.fixture(scope="module")
def simulated_gpus():
    from flash.cluster import init_ray

    init_ray(None, num_cpus=2, num_gpus=2)
    yield
    ray.shutdown()


def _where():
    return ray.get_gpu_ids(), str(actor_device())


def test_an_actor_given_a_simulated_gpu_runs_on_the_cpu(simulated_gpus):
    probe = ray.remote(_where)
    gpus, device = ray.get(probe.options(num_cpus=0, num_gpus=1).remote())
    assert len(gpus) == 1 and device == "cpu"  # Ray gave it a GPU, but there is no CUDA here
    gpus, device = ray.get(probe.options(num_cpus=0).remote())
    assert gpus == [] and device == "cpu"


def test_dtype_names():
    assert torch_dtype("bfloat16") == torch.bfloat16 and torch_dtype("float16") == torch.float16
    assert autocast_dtype("float32") is None and autocast_dtype("bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="model.dtype must be one of float32, bfloat16, float16, got 'bf16'"):
        torch_dtype("bf16")


def test_autocast_is_no_context_for_float32_and_casts_matmuls_otherwise():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with autocast(torch.device("cpu"), None):
        assert (a @ b).dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
    with autocast(torch.device("cpu"), torch.bfloat16):
        assert (a @ b).dtype == torch.bfloat16


def test_peak_memory_is_read_on_a_gpu_only_and_a_group_reports_its_largest_rank():
    from flash.devices import max_peak_memory, read_peak_memory

    assert read_peak_memory(torch.device("cpu")) == {} and read_peak_memory(None) == {}
    assert max_peak_memory([{"busy_s": 1.0}, {"mem_peak_gb": 3.5}, {"mem_peak_gb": 7.25}]) == {"mem_peak_gb": 7.25}
    assert max_peak_memory([{"busy_s": 1.0}]) == {}


def test_each_role_s_peak_memory_is_a_step_metric():
    from flash.controllers.step_metrics import RoleUsage

    usage = RoleUsage(clock=lambda: 0.0)
    usage.start({"busy_s": 0.0}, {"busy_s": 0.0})
    m = usage.read({"busy_s": 1.0, "mem_peak_gb": 2.5}, {"busy_s": 2.0, "mem_peak_gb": 11.0}, step_s=4.0)
    assert (m["memory/rollout_peak_gb"], m["memory/train_peak_gb"]) == (2.5, 11.0)
    assert "memory/train_peak_gb" not in usage.read({"busy_s": 1.0}, {"busy_s": 2.0}, step_s=4.0)
