"""The vLLM engine actor's weight updates (``VLLMUpdates``, a base of
``flash.engine.vllm_engine.VLLMEngineWorker``; how they reach vLLM: that module's docstring,
**Weights**): the model-update group's ``mu_*`` calls forwarded to vLLM's worker
(``vllm_weights.WeightSync``) and ``update_weights``' buckets, written only while the engine is
paused, awake and has nothing running in vLLM; the prefix cache is reset after each.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from flash.devices import actor_device
from flash.engine.vllm_weights import check_push, layer_buckets, weights_blob, wire_sent
from flash.weights.group import UpdateReceiver


class VLLMUpdates(UpdateReceiver):
    """The weight side of the vLLM engine actor. The host (``VLLMEngineWorker``) holds the engine
    (``_llm``, run through ``_call`` on its loop, checked alive by ``_check`` and ``_errored``), its
    state (``_paused``, ``_asleep``, ``_reqs``, ``_closed``, ``_version``) and the checkpoint's facts
    (``_shapes``, ``_tied``, ``_dtype``, ``_rpc_bucket_bytes``, ``_tp``)."""

    def _weights_ready(self) -> None:
        """Raise unless weights may be written now: paused, awake, nothing running in vLLM."""
        if self._paused is None:
            raise RuntimeError("update_weights needs a paused engine; call pause(mode) first")
        if self._asleep is not None:
            raise RuntimeError("the engine is asleep; call wake_up() before update_weights()")
        if self._reqs:
            raise RuntimeError(f"update_weights with {len(self._reqs)} requests still running in vLLM")

    async def _weights_loaded(self, version: int) -> None:
        if not await self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")
        self._version = version

    async def _update_weights(self, named_tensors, version: int) -> float:
        """Bucket by bucket (whole layers, the engine's dtype): one blob per ``collective_rpc``.
        A mapping is checked whole before anything is loaded."""
        from flash.devices import torch_dtype

        self._weights_ready()
        if isinstance(named_tensors, Mapping):
            check_push(named_tensors, self._shapes, self._tied)
            named_tensors = named_tensors.items()
        sent = 0
        for bucket in layer_buckets(
            named_tensors, self._shapes, self._tied, self._rpc_bucket_bytes, torch_dtype(self._dtype)
        ):
            blob = weights_blob(bucket, self._shapes)
            await self._llm.collective_rpc("flash_load_weights", args=(blob,))
            sent += len(blob)
        await self._weights_loaded(version)
        return float(sent)

    async def _mu_receive(self, group: str, version: int, sent) -> dict:
        self._weights_ready()
        out = (await self._llm.collective_rpc("mu_receive", args=(group, version, sent)))[0]
        await self._weights_loaded(version)
        return out

    def _mu_device(self) -> torch.device:
        """Where the weights live: the GPU the placement gave this actor (vLLM's worker process
        inherits its ``CUDA_VISIBLE_DEVICES`` and loads the model there), else the CPU."""
        return actor_device()

    def _worker_rpc(self, method: str, *args):
        """``method`` on vLLM's workers (one per tensor-parallel rank, each a member); the first's result."""
        self._check()
        return self._call(self._llm.collective_rpc(method, args=args))[0]

    def mu_dtypes(self) -> dict[str, str]:
        """The engine's dtype for every pushed name: the trainer casts to it before sending."""
        return {name: self._dtype for name in self._mu_shapes()}

    def _mu_shapes(self) -> dict:
        """The checkpoint's shapes, plus a tied LM head's (trainers send it)."""
        embed = self._shapes.get("model.embed_tokens.weight")
        return {**self._shapes, **({n: embed for n in self._tied} if embed is not None else {})}

    def mu_members(self) -> int:
        return self._tp

    def mu_join(self, group: str, backend: str, host: str, port: int, rank: int, world: int, timeout_s: float) -> None:
        self._worker_rpc("mu_join", group, backend, host, port, rank, world, timeout_s)

    def mu_check(self, group: str, wire: list) -> int:
        """The plan checked by vLLM's worker against its checkpoint, and this engine ready for it
        (paused, awake), before any byte moves."""
        self._check()
        self._weights_ready()
        return self._worker_rpc("mu_check", group, wire)

    def engine_weights(self) -> dict:
        """vLLM's parameters under its own (fused) names, CPU copies (on CPU, a linear layer's
        weight lives packed in its oneDNN handle and reads back empty)."""
        from safetensors.torch import load

        return load(bytes(self._worker_rpc("flash_state")))

    def mu_receive(self, group: str, version: int, sent: dict | None = None) -> dict[str, float]:
        """vLLM's worker receives and loads the push; then the prefix cache is reset and the
        engine takes ``version``."""
        self._check()
        return self._call(self._mu_receive(group, version, wire_sent(sent)))

    def mu_close(self, group: str) -> None:
        if not self._closed and not self._errored():
            self._worker_rpc("mu_close", group)

    def _mu_apply(self, items, version: int) -> None:
        """Pushed ``(name, tensor)`` pairs loaded by the bucketed RPC path (``update_weights``);
        a group's push goes to vLLM's worker directly instead (``mu_receive``)."""
        self.update_weights(items, version)

    def update_weights(self, named_tensors, version: int) -> float:
        """Load weights in place (only while paused); returns the bytes sent to vLLM's worker."""
        self._check()
        return self._call(self._update_weights(named_tensors, version))
