"""A trainer step on the GPU makes no host sync inside its micro-batch loop.

``torch.cuda.set_sync_debug_mode("error")`` turns every call that blocks the host on the GPU (a
``.item()``/``float()``/``bool()`` of a device tensor, a blocking copy to or from the host, a
stream synchronize) into a RuntimeError naming it. Which syncs a step may make:

- none in ``accumulate``: its forward and backward passes over the micro-batches (here 4), the
  loss and metric sums and the train-inference mismatch of the fused proximal logprobs must stay
  on the device, so the GPU never waits for the host between micro-batches ("error" around it);
- a few in ``finish_step``, once per optimizer step: whether the gradient is finite (skip the step
  or not) and the metrics handed back as floats ("default" around it);
- none for the batch's upload: it arrives from the driver on the CPU, as in a run, its rows'
  lengths are read there, and its copy to the GPU is queued without the host waiting.

The model's forward is transformers' (its SDPA mask code would read the padding mask on every
forward); the trainer gives it the causal-only form of ``flash.train.attention``, which reads
nothing. The body (``step_under``) also runs on CPU in the default suite (tests/integration/test_gpu_bodies.py),
with a counter of host reads from every caller in place of sync debug mode.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from flash.train.trainer import Trainer
from tests.helpers.train import make_batch, settings, toy_model

ROWS, MICRO_BATCHES = 8, 4


@contextmanager
def sync_debug(mode: str):
    torch.cuda.synchronize()  # what came before is not the step's
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def step_under(device: torch.device, guard) -> None:
    """One step on ``device``, its parts under ``guard(mode)`` ("error": no sync allowed)."""
    trainer = Trainer(toy_model().to(device), settings(micro_batch_size=ROWS // MICRO_BATCHES), seed=0)
    batch, adv = make_batch(seed=1, n=ROWS, vocab=32)  # on the CPU, as the driver sends it
    trainer.begin_step()
    with guard("error"):  # upload; 4 micro-batches: forward, loss, backward, sums on the device
        trainer.accumulate(batch, adv, None)  # prox fused into the forward, as the default recipe runs
    with guard("default"):  # once per optimizer step: the finite check and the float metrics
        metrics = trainer.finish_step()
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0 and metrics["skipped"] == 0.0
    assert trainer.steps == 1


def test_accumulate_makes_no_host_sync():
    step_under(torch.device("cuda"), sync_debug)
