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

import torch
from tests.helpers.gpu_bodies import step_under, sync_debug


def test_accumulate_makes_no_host_sync():
    step_under(torch.device("cuda"), sync_debug)
