"""Where a role's model runs and in which precision.

Every role that a placement (``flash.placement``) can give a device -- the trainer, the FSDP2
ranks, the reference, the critic, the torch engine replicas -- asks ``actor_device`` once and
runs its model there. Ray tells an actor its GPUs (``ray.get_gpu_ids()``) and sets
``CUDA_VISIBLE_DEVICES`` to them, so the local index is the current device among the visible
ones (0 unless the process chose another); no index is written anywhere else.

``model.dtype`` names the compute precision (``DTYPES``): the engine holds its weights in it; a
trainer keeps float32 master weights and optimizer state and runs its forward under ``autocast``
(float32: no context at all, so a float32 run is the exact same computation as without it).
Logprobs are always taken in float32 from the logits.
"""

from __future__ import annotations

import contextlib
import math

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_for(gpu_ids: list, cuda_available: bool, current: int = 0) -> torch.device:
    """The device of an actor that Ray gave ``gpu_ids`` (empty: none): the current CUDA device
    when it has GPUs and CUDA works, else the CPU (e.g. GPUs simulated with ``ray.init(num_gpus=N)``)."""
    return torch.device("cuda", current) if gpu_ids and cuda_available else torch.device("cpu")


def actor_device() -> torch.device:
    """This process's device: a GPU when it runs in a Ray actor given GPUs, else the CPU."""
    import ray

    gpus = ray.get_gpu_ids() if ray.is_initialized() else []
    cuda = bool(gpus) and torch.cuda.is_available()
    return device_for(gpus, cuda, torch.cuda.current_device() if cuda else 0)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``model.dtype`` name."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"model.dtype must be one of {', '.join(DTYPES)}, got {name!r}") from None


def autocast_dtype(name: str) -> torch.dtype | None:
    """The dtype a float32-master trainer computes its forward in; None for float32 (no autocast)."""
    dtype = torch_dtype(name)
    return None if dtype == torch.float32 else dtype


def autocast(device: torch.device, dtype: torch.dtype | None):
    """``torch.autocast`` to ``dtype`` on ``device``'s kind; a null context when ``dtype`` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


# cuBLAS reads this in every process that inherits it (an engine actor and vLLM's workers): float32
# matmuls in TF32 whatever the process itself sets. CPU matmuls never read it.
TF32_ENV = {"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"}


def tf32_wanted(device: torch.device | str, dtype: str, enabled: bool) -> bool:
    """Whether a role runs its float32 matmuls in TF32 (10-bit mantissa inputs, float32
    accumulation: several times the float32 matmul rate on Ampere and later): ``resources.tf32`` on,
    ``model.dtype`` float32 (a bf16/fp16 run computes its matmuls in that dtype anyway) and a CUDA
    device. Never on the CPU: a CPU run's numerics stay exact float32."""
    return enabled and dtype == "float32" and torch.device(device).type == "cuda"


def use_tf32(device: torch.device | str, dtype: str, enabled: bool) -> bool:
    """Switch this process's CUDA matmuls and cuDNN to TF32 where ``tf32_wanted``; True when it did.
    The CUDA-only flags: ``torch.set_float32_matmul_precision("high")`` would switch the CPU's
    oneDNN matmuls too, and torch's per-backend ``fp32_precision`` setters, once mixed with the
    flags other libraries read, make ``torch.get_float32_matmul_precision()`` raise."""
    if not tf32_wanted(device, dtype, enabled):
        return False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return True


def tf32_env(devices: tuple[int, ...], dtype: str, enabled: bool) -> dict[str, str]:
    """The environment of an engine worker placed on ``devices`` (none: the CPU) that makes its
    process, and those it starts, compute float32 matmuls in TF32 where ``tf32_wanted``."""
    return dict(TF32_ENV) if tf32_wanted("cuda" if devices else "cpu", dtype, enabled) else {}


def model_device(model) -> torch.device:
    """Where a model's parameters live."""
    return next(model.parameters()).device


def release_cached_memory(device: torch.device | None) -> bool:
    """Hand the blocks torch's CUDA caching allocator keeps but no tensor uses back to the driver
    (``torch.cuda.empty_cache``), so that a role sharing the GPU can allocate them; True when it
    did. Nothing to do elsewhere (on the CPU a freed tensor's memory goes back at once)."""
    if device is None or device.type != "cuda":
        return False
    torch.cuda.empty_cache()
    return True


# What a trainer keeps on its GPU between steps, per parameter: fp32 master weights (4 bytes), fp32
# gradients (4; dropped at the next step's start) and AdamW's two fp32 moments (8); its activations
# are freed (``release_cached_memory``). A local KL reference adds its fp32 copy (4).
TRAINER_BYTES_PER_PARAM, REFERENCE_BYTES_PER_PARAM = 16, 4
COLOCATED_HEADROOM_BYTES = 2 * 2**30  # both processes' CUDA contexts, the allocators' fragmentation
MAX_ENGINE_FRACTION, MIN_ENGINE_FRACTION = 0.9, 0.05  # vLLM's default; less is no useful KV cache


def colocated_engine_fraction(
    total_bytes: int, trainer_bytes: float, headroom_bytes: int = COLOCATED_HEADROOM_BYTES
) -> float:
    """The share of a GPU's memory an engine colocated with a trainer may take (vLLM's
    ``gpu_memory_utilization``): what the trainer's resident ``trainer_bytes`` and the headroom
    leave, at most vLLM's default, rounded down to 0.001; a ValueError naming the fix when
    almost nothing is left."""
    share = (total_bytes - trainer_bytes - headroom_bytes) / total_bytes
    if share < MIN_ENGINE_FRACTION:
        raise ValueError(
            f"a colocated engine would get {max(share, 0.0):.1%} of the GPU's {total_bytes / 2**30:.0f} "
            f"GiB (the trainer keeps {trainer_bytes / 2**30:.1f} GiB): give actor_infer its own devices, "
            f"or more trainer ranks to shard over"
        )
    return math.floor(min(share, MAX_ENGINE_FRACTION) * 1000) / 1000


def read_peak_memory(device: torch.device | None) -> dict[str, float]:
    """``{"mem_peak_gb": ...}``: the most memory this process held on ``device`` since the previous
    read (then the peak is reset, so each read covers the role's work in between: for colocated
    roles, their phase of the step); nothing on the CPU, where torch keeps no such count."""
    if device is None or device.type != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    torch.cuda.reset_peak_memory_stats(device)
    return {"mem_peak_gb": peak}


def max_peak_memory(reads: list[dict[str, float]]) -> dict[str, float]:
    """The largest ``mem_peak_gb`` of several processes' reads (a group's ranks); nothing if none has one."""
    peaks = [r["mem_peak_gb"] for r in reads if "mem_peak_gb" in r]
    return {"mem_peak_gb": max(peaks)} if peaks else {}
