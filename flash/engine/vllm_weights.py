"""Weights into a running vLLM engine: the worker extension that loads a push in place, and the
checks a push passes first (known names, checkpoint shapes, whole fused layers).

Why in its own module: vLLM imports ``WeightSync`` by name in each of its worker processes, and
the checks are pure functions of the checkpoint's shapes, testable without vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from algos.registry import did_you_mean


class WeightSync:
    """vLLM worker extension (``worker_extension_cls``): load pushed weights in place."""

    def flash_load_weights(self, blob: bytes) -> int:
        from safetensors.torch import load
        from vllm.config import set_current_vllm_config

        weights = load(bytes(blob))
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
            _refresh_cpu_gemms(self.model_runner.get_model())
        return len(weights)


def _refresh_cpu_gemms(model) -> None:
    """Re-pack the oneDNN GEMMs of layers that keep their weight (embedding, LM head) on CPU.

    A tied LM head shares the embedding's weight, so the layer-wise reload updates that tensor
    but never re-processes the head, whose packed copy would go on computing old logits. Layers
    whose weight was dropped after packing (plain linears) were re-packed by the reload itself.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and weight is not None and weight.ndim == 2 and weight.numel():
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """Name → shape of every tensor in the checkpoint's safetensors files (headers only)."""
    from safetensors import safe_open

    shapes = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            shapes.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
    return shapes


def weights_blob(named_tensors, shapes: Mapping, tied: set[str] | frozenset[str] = frozenset()) -> bytes:
    """Check names and shapes against the checkpoint's (before anything is loaded), then pack as
    safetensors: what ``WeightSync.flash_load_weights`` receives. Tied names are sent once."""
    from safetensors.torch import save

    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    tensors = {}
    for name, tensor in items:
        if name in tied:
            continue
        if name not in shapes:
            raise KeyError(f"unknown parameter {name!r}{did_you_mean(name, shapes, n=1)}")
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} != model's {shapes[name]}")
        tensors[name] = tensor.detach().to("cpu").contiguous().clone()  # owned: no shared storage
    check_whole_layers(tensors, shapes)
    return save(tensors)


_FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def check_whole_layers(tensors: Mapping, shapes: Mapping) -> None:
    """A push may be partial (buckets) but must hold whole vLLM layers.

    vLLM fuses q/k/v and gate/up into one layer and re-processes a layer once all of its tensors
    arrived; a layer given only in part would be re-processed from half-loaded memory.
    """
    def layer(name: str) -> str:
        module, _, _ = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        return f"{parent}.{_FUSED.get(leaf, leaf)}"

    wanted: dict[str, set[str]] = {}
    for name in shapes:
        wanted.setdefault(layer(name), set()).add(name)
    for key in {layer(n) for n in tensors}:
        missing = sorted(wanted[key] - set(tensors))
        if missing:
            raise ValueError(f"a weight push must hold whole layers: {key} lacks {', '.join(missing)}")
