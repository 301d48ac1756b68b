"""The reference role: the frozen initial policy that a KL penalty (``algo.loss.kl_coef``) reads.

Two places can hold it. By default the trainer keeps a frozen copy of its initial weights beside
the policy (``TrainerSettings.reference = "local"``): no extra process, but the trainer pays the
reference forward inside its step and holds a second model. With a ``reference`` worker placed
(``placement.roles.reference.num_workers: 1``, on its own devices or CPU-only), the copy lives in
its own actor (``"role"``): the controller asks it for the batch's reference logprobs as soon as
the batch is collated, so the reference forward overlaps the proximal recompute and the
advantages, and the trainer holds one model. This is the placed ``reference`` cluster of ROLL and
the separate ref worker of verl, OpenRLHF and AReaL.

Both compute the same numbers: the reference is the checkpoint the run starts from (after the
warm start), its logprobs are taken at the rollout temperature like every other policy's
(``flash.train.trainer.batch_logprobs``), micro-batched, without gradient, on the device Ray gave
the actor and with the trainer's precision (float32 weights, the forward under autocast to
``model.dtype``).
"""

from __future__ import annotations

import time

import ray
import torch

from flash.cluster import load_model
from flash.devices import actor_device, autocast_dtype, use_tf32
from flash.train.attention import causal_attention
from flash.train.batch import TrainBatch, batch_to
from flash.train.trainer import batch_logprobs


class Reference:
    """The frozen initial policy as an actor: ``logprobs(batch)`` only (it never trains)."""

    def __init__(
        self,
        model_path: str,
        temperature: float,
        micro_batch_size: int,
        threads: int = 1,
        dtype: str = "float32",
        tf32: bool = True,
    ):
        torch.set_num_threads(max(1, threads))
        self.device, self.autocast = actor_device(), autocast_dtype(dtype)
        use_tf32(self.device, dtype, tf32)  # the trainer's matmul precision, so both logprobs agree
        self.model = causal_attention(load_model(model_path).to(self.device).eval())  # right-padded batches
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.temperature, self.micro_batch_size = temperature, micro_batch_size
        self.busy_s, self.calls = 0.0, 0

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``[N, L-1]`` reference logprobs of the batch's target tokens (0 off the response mask)."""
        start = time.monotonic()
        out = batch_logprobs(
            self.model,
            batch_to(batch, self.device),
            self.temperature,
            self.micro_batch_size,
            dtype=self.autocast,
            span_head=self.autocast is not None,
        ).cpu()
        self.busy_s += time.monotonic() - start
        self.calls += 1
        return out

    def stats(self) -> dict:
        """Busy seconds and calls; also the readiness ping (``flash.cluster.wait_ready``)."""
        return {"busy_s": self.busy_s, "calls": float(self.calls)}


def start_reference(
    model_path: str,
    temperature: float,
    micro_batch_size: int,
    threads: int,
    options: dict | None = None,
    dtype: str = "float32",
    tf32: bool = True,
):
    """The reference role as its own Ray actor, placed by ``options`` (``Placement.options``)."""
    actor = ray.remote(Reference).options(num_cpus=0, **(options or {}))
    return actor.remote(model_path, temperature, micro_batch_size, threads, dtype, tf32)
