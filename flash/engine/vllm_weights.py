"""Weights into a running vLLM engine: the worker extension that joins the model-update group and
loads each push in place, and the checks a push passes first (known names, checkpoint shapes,
whole fused layers).

Why in its own module: vLLM imports ``WeightSync`` by name in each of its worker processes, and
the checks are pure functions of the checkpoint's shapes, testable without vLLM.

How a push reaches vLLM's weights (``VLLMEngineWorker`` forwards the group's ``mu_*`` calls here
through ``collective_rpc``; only small plain values travel that way):

- **gloo, nccl, shm, cuda_ipc**: vLLM's worker is itself the group's member (``UpdateReceiver``):
  it joins the trainer's process group (gloo on CPU, NCCL on GPUs) and receives the planned
  buckets (``model_update.bucket_mb`` each, cast to the engine's dtype by the trainer) into its own
  buffers on its own device, or maps the colocated shared-memory segment or CUDA buffer; every
  tensor is cast (copied) to the model's dtype as it arrives and handed to the model's
  ``load_weights`` through one in-place ``reload_weights`` pass, which processes each vLLM layer
  once all its tensors arrived. No whole-model copy exists anywhere and nothing heavy crosses
  an RPC, as in vLLM's RLHF examples, OpenRLHF and NeMo-RL.
- **object_store** (and ``update_weights``): the weights reach the engine actor, as the baseline
  path has them; they go on to vLLM's worker in buckets of whole vLLM layers in the engine's
  dtype (``layer_buckets``), one safetensors blob of at most ``rpc_bucket_mb`` (or one layer, if
  larger) per ``collective_rpc``, each loaded by its own ``reload_weights``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

from flash.algos.registry import did_you_mean
from flash.weights.cuda_ipc import handle_from_wire, handle_to_wire
from flash.weights.group import UpdateReceiver

TIED = ("model.embed_tokens.weight", "lm_head.weight")  # one tensor in a tied model


def request_amx() -> bool:
    """Ask Linux for this process's AMX tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, through
    torch) on a CPU that has AMX; True when it is granted. vLLM's CPU attention for bfloat16 runs
    AMX tile instructions without asking, and oneDNN asks only at its own first AMX use, so a
    worker whose first AMX instruction is vLLM's dies of SIGILL. The permission is per process and
    asking twice is harmless."""
    if not torch.cpu._is_amx_tile_supported():
        return False
    return bool(torch.cpu._init_amx())


request_amx()  # in each vLLM worker process, which imports this module before it loads the model


class WeightSync(UpdateReceiver):
    """vLLM worker extension (``worker_extension_cls``): a member of the model-update group inside
    vLLM's worker, and the loader of pushed blobs."""

    def flash_load_weights(self, blob: bytes) -> int:
        """Load one safetensors blob of whole layers in place; returns its tensor count."""
        from safetensors.torch import load

        weights = load(bytes(blob))
        self._flash_reload(iter(weights.items()))
        return len(weights)

    def flash_state(self) -> bytes:
        """The model's parameters under vLLM's own (fused) names, as safetensors bytes."""
        from safetensors.torch import save

        return save(
            {n: p.detach().to("cpu").contiguous().clone() for n, p in self.model_runner.get_model().named_parameters()}
        )

    def _flash_reload(self, weights: Iterable) -> None:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            self.model_runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
            _refresh_cpu_gemms(self.model_runner.get_model())

    # ---- the model-update group's receiver (flash.weights.group.UpdateReceiver) ----------------
    def _mu_tied(self) -> bool:
        text = self.vllm_config.model_config.hf_config.get_text_config(decoder=True)
        return bool(getattr(text, "tie_word_embeddings", False))

    def _mu_shapes(self) -> dict:
        """The checkpoint's shapes, plus a tied LM head's (trainers send it; it is loaded once)."""
        if not hasattr(self, "_flash_shapes"):
            shapes = checkpoint_shapes(self.vllm_config.model_config.model)
            if self._mu_tied() and TIED[0] in shapes:
                shapes[TIED[1]] = shapes[TIED[0]]
            self._flash_shapes = shapes
        return self._flash_shapes

    def _mu_ties(self) -> list[tuple[str, ...]]:
        return [TIED] if self._mu_tied() else []

    def _mu_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def mu_join(self, group: str, backend: str, host: str, port: int, rank: int, world: int, timeout_s: float) -> None:
        """Join as rank ``rank`` + this worker's tensor-parallel rank: every rank receives the
        whole tensors and the model's ``load_weights`` keeps its own shard of each."""
        super().mu_join(group, backend, host, port, rank + int(getattr(self, "rank", 0)), world, timeout_s)

    def mu_receive(self, group: str, version: int, sent: dict | None = None) -> dict[str, float]:
        """``UpdateReceiver.mu_receive`` with a CUDA IPC handle read back from its wire form."""
        if sent is not None and sent.get("handle") is not None:
            sent = {**sent, "handle": handle_from_wire(sent["handle"])}
        return super().mu_receive(group, version, sent)

    def _mu_apply(self, items, version: int) -> None:
        """Each received tensor copied in the model's dtype (the group's buffers are reused) and
        loaded as it arrives; ``version`` is the engine actor's to set."""
        dtype = self.vllm_config.model_config.dtype
        self._flash_reload((name, t.to(dtype, copy=True)) for name, t in items)


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


def wire_sent(sent: Mapping | None) -> dict | None:
    """A colocated push's ``mu_send`` result as plain values for ``collective_rpc``."""
    if sent is None:
        return None
    return {**sent, "handle": handle_to_wire(sent["handle"]) if sent.get("handle") is not None else None}


def checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """Name → shape of every tensor in the checkpoint's safetensors files (headers only)."""
    from safetensors import safe_open

    shapes = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            shapes.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
    return shapes


def layer_buckets(
    items: Iterable,
    shapes: Mapping,
    tied: set[str] | frozenset[str] = frozenset(),
    bucket_bytes: int = 512 << 20,
    dtype: torch.dtype | None = None,
) -> Iterator[dict]:
    """``(name, tensor)`` pairs as buckets of whole vLLM layers, each tensor copied to the host
    in ``dtype`` (None: its own) as it arrives: a bucket is yielded before it would pass
    ``bucket_bytes`` (a layer larger than that is a bucket of its own), so at most one bucket and
    the layers still incomplete are held. Names and shapes are checked as they arrive; a layer
    still incomplete at the end is an error. Tied names are skipped (sent once)."""
    wanted: dict[str, set[str]] = {}
    for name in shapes:
        if name not in tied:
            wanted.setdefault(_layer(name), set()).add(name)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    bucket, fill = {}, 0
    for name, tensor in items:
        if name in tied:
            continue
        _check_tensor(name, tensor, shapes)
        layer = pending.setdefault(_layer(name), {})
        layer[name] = tensor.detach().to("cpu", dtype or tensor.dtype, copy=True)
        if set(layer) != wanted[_layer(name)]:
            continue
        size = sum(t.numel() * t.element_size() for t in pending.pop(_layer(name)).values())
        if bucket and fill + size > bucket_bytes:
            yield bucket
            bucket, fill = {}, 0
        bucket.update(layer)
        fill += size
    for layer in pending.values():
        check_whole_layers(layer, shapes)
    if bucket:
        yield bucket


def _check_tensor(name: str, tensor: torch.Tensor, shapes: Mapping) -> None:
    if name not in shapes:
        raise KeyError(f"unknown parameter {name!r}{did_you_mean(name, shapes, n=1)}")
    if tuple(tensor.shape) != shapes[name]:
        raise ValueError(f"{name}: shape {tuple(tensor.shape)} != model's {shapes[name]}")


def check_push(
    tensors: Mapping[str, torch.Tensor], shapes: Mapping, tied: set[str] | frozenset[str] = frozenset()
) -> None:
    """Every name known, every shape the checkpoint's, every vLLM layer whole: before any load."""
    kept = {n: t for n, t in tensors.items() if n not in tied}
    for name, tensor in kept.items():
        _check_tensor(name, tensor, shapes)
    check_whole_layers(kept, shapes)


def weights_blob(named_tensors, shapes: Mapping, tied: set[str] | frozenset[str] = frozenset()) -> bytes:
    """Check names and shapes against the checkpoint's (before anything is loaded), then pack as
    safetensors: what ``WeightSync.flash_load_weights`` receives. Tied names are sent once."""
    from safetensors.torch import save

    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    tensors = {}
    for name, tensor in items:
        if name in tied:
            continue
        _check_tensor(name, tensor, shapes)
        tensors[name] = tensor.detach().to("cpu").contiguous().clone()  # owned: no shared storage
    check_whole_layers(tensors, shapes)
    return save(tensors)


_FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def check_whole_layers(tensors: Mapping, shapes: Mapping) -> None:
    """A push may be partial (buckets) but must hold whole vLLM layers.

    vLLM fuses q/k/v and gate/up into one layer and re-processes a layer once all of its tensors
    arrived; a layer given only in part would be re-processed from half-loaded memory.
    """
    wanted: dict[str, set[str]] = {}
    for name in shapes:
        wanted.setdefault(_layer(name), set()).add(name)
    for key in {_layer(n) for n in tensors}:
        missing = sorted(wanted[key] - set(tensors))
        if missing:
            raise ValueError(f"a weight push must hold whole layers: {key} lacks {', '.join(missing)}")


def _layer(name: str) -> str:
    """The vLLM layer a checkpoint tensor loads into (q/k/v and gate/up are fused)."""
    module, _, _ = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    return f"{parent}.{_FUSED.get(leaf, leaf)}"
