"""Host reads per optimizer step: a fixed few, however many micro-batches the step has.

Every host read of a tensor (``item``, ``float``, ``int``, ``bool``, ``tolist``, ``cpu``) is
counted by wrapping those ``torch.Tensor`` methods; on a GPU each is a device sync. Every caller
counts, the model's forward in transformers included (its SDPA mask code read the padding mask
on every forward, two reads per micro-batch, until the trainer's forward took the causal-only
form of ``flash.train.attention``). Not counted: reads of AdamW's step counters, which torch keeps
in host memory whatever the device (no sync). One optimizer step over 4 and over 8 micro-batches
must make the same number: the metrics stay tagged tensors on the device until the step ends
(``flash.algos.metrics``), then move in one transfer.
"""

from __future__ import annotations

import copy

import pytest
import torch

from flash.train.batch import collate
from flash.train.trainer import Trainer
from tests.helpers.host_reads import READS, Counter
from tests.helpers.train import toy_model, toy_samples, toy_settings

MAX_READS = 2  # accumulate: the rows' lengths and weight; finish_step: metrics and grad norm


@pytest.fixture(scope="module")
def model():
    return toy_model()


def reads_per_step(monkeypatch, model, micro_batches: int, loss: dict, mismatch: bool = True) -> list[str]:
    """The counted reads of one optimizer step (``train_step``, fused prox) over 16 rows."""
    counter = Counter()
    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counter.wrap(name))
    batch = collate(toy_samples(n=16))
    batch.behav_logp = batch.behav_logp - 0.3 * batch.mask
    adv = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(3)) * batch.mask
    tr = Trainer(copy.deepcopy(model), toy_settings(loss=loss, micro_batch_size=16 // micro_batches))
    counter.on, counter.optimizer = True, tr.optimizer
    metrics = tr.train_step(batch, adv, None)
    counter.on = False
    monkeypatch.undo()
    assert ("mismatch_kl" in metrics) == mismatch and metrics["skipped"] == 0.0
    return counter.calls


LOSSES = {
    "fused_prox": {"name": "decoupled_ppo"},
    "corrections": {"name": "ppo", "corrections": [{"name": "token_is"}, {"name": "m2po"}]},
    "kl_and_entropy": {"name": "cispo", "kl_coef": 0.1, "entropy_coef": 0.01},
}


@pytest.mark.parametrize("case", sorted(LOSSES))
def test_host_syncs_per_step_do_not_grow_with_micro_batches(monkeypatch, model, case):
    four = reads_per_step(monkeypatch, model, 4, LOSSES[case])
    eight = reads_per_step(monkeypatch, model, 8, LOSSES[case])
    assert len(four) == len(eight), (four, eight)
    assert len(four) <= MAX_READS, four


def test_host_syncs_stream_step_reads_once_per_part(monkeypatch, model):
    """The stream trainer's step: one read per part fed (its lengths), one at the end."""
    counter = Counter()
    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counter.wrap(name))
    batch = collate(toy_samples(n=16))
    adv = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(3)) * batch.mask
    tr = Trainer(copy.deepcopy(model), toy_settings(loss={"name": "ppo"}, micro_batch_size=2))
    parts = [(batch.rows(lo, hi), lo, hi) for lo, hi in ((0, 8), (8, 16))]
    counter.on, counter.optimizer = True, tr.optimizer
    tr.begin_step()
    for part, lo, hi in parts:
        tr.accumulate(part, adv[lo:hi, : part.mask.shape[1]], part.behav_logp)
    tr.finish_step()
    counter.on = False
    assert len(counter.calls) == 3, counter.calls
