"""The critic role: a value model for the ``gae`` estimator.

The critic is the policy checkpoint's transformer body (``AutoModel``: no LM head) with a scalar
head initialised to zero, so its first values are 0 and GAE starts as plain reward-to-go. It runs
as its own Ray actor (the ``critic`` role), so in the controller's step it scores the batch
before the advantages and trains *beside* the policy's step (both only need the batch, the
values and the returns). Values are aligned like logprobs (``flash.train.batch``): column ``j`` is the
value of the state after tokens ``0..j``, i.e. before the target token ``j+1``. It runs on the
device Ray gave its actor (``flash.devices.actor_device``), in float32.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from flash.algos.value import value_loss
from flash.devices import actor_device
from flash.train.batch import TrainBatch, batch_to
from flash.train.trainer import micro_weight


@dataclass(frozen=True)
class CriticSettings:
    lr: float = 5e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    value_clip: float | None = 0.2
    micro_batch_size: int = 64


class Critic:
    def __init__(self, model_path: str, settings: CriticSettings, seed: int = 0, threads: int = 1):
        from transformers import AutoModel

        torch.set_num_threads(max(1, threads))
        torch.manual_seed(seed)
        self.s = settings
        self.device = actor_device()
        self.body = AutoModel.from_pretrained(model_path, dtype=torch.float32).to(self.device)
        hidden = self.body.config.get_text_config(decoder=True).hidden_size
        self.head = torch.nn.Linear(hidden, 1, device=self.device)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        params = list(self.body.parameters()) + list(self.head.parameters())
        self.optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
        self.steps, self.busy_s = 0, 0.0

    def _forward(self, part: TrainBatch) -> torch.Tensor:
        hidden = self.body(input_ids=part.input_ids, attention_mask=part.attention_mask).last_hidden_state
        return self.head(hidden[:, :-1]).squeeze(-1)

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """``[N, L-1]`` values on response tokens (0 elsewhere), micro-batched."""
        start = time.monotonic()
        self.body.eval()
        batch = batch_to(batch, self.device)
        out = torch.zeros_like(batch.mask)
        for lo in range(0, len(batch), self.s.micro_batch_size):
            part = batch.rows(lo, min(lo + self.s.micro_batch_size, len(batch)))
            v = self._forward(part)
            out[lo : lo + len(part), : v.shape[1]] = v * part.mask
        self.busy_s += time.monotonic() - start
        return out.cpu()

    def train_step(self, batch: TrainBatch, returns: torch.Tensor, old_values: torch.Tensor) -> dict[str, float]:
        """One optimizer step of the clipped value loss over the whole batch (token-mean,
        micro-batches weighted by their token share, so the step equals the full-batch step)."""
        start = time.monotonic()
        self.body.train()
        self.optimizer.zero_grad(set_to_none=True)
        batch, returns, old_values = batch_to(batch, self.device), returns.to(self.device), old_values.to(self.device)
        whole = float(batch.mask.sum())
        sums: dict[str, float] = {}
        for lo in range(0, len(batch), self.s.micro_batch_size):
            hi = min(lo + self.s.micro_batch_size, len(batch))
            part = batch.rows(lo, hi)
            width = part.mask.shape[1]
            loss, metrics = value_loss(
                self._forward(part), old_values[lo:hi, :width], returns[lo:hi, :width], part.mask, self.s.value_clip
            )
            w = micro_weight("token-mean", part, whole, len(batch))
            (loss * w).backward()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + w * v
        params = list(self.body.parameters()) + list(self.head.parameters())
        sums["critic/grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, self.s.grad_clip))
        self.optimizer.step()
        self.steps += 1
        self.busy_s += time.monotonic() - start
        return sums

    def stats(self) -> dict[str, float]:
        return {"busy_s": self.busy_s, "steps": float(self.steps)}
