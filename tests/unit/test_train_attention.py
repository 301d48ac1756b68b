"""The trainer's forward takes the causal-only attention of ``flash.train.attention``: at every
real position of a right-padded batch its logits are the 2D-mask forward's, bit for bit, so a
float32 run's numbers stay what they were, and the forward reads nothing from the device."""

from __future__ import annotations

import copy
import sys

import torch

from flash.train.attention import CAUSAL_SDPA, causal_attention
from flash.train.batch import collate
from flash.train.trainer import Trainer
from tests.helpers.train import toy_model, toy_samples, toy_settings


def logits(model, input_ids, attention_mask):
    with torch.no_grad():
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def test_causal_attention_matches_the_padded_mask_forward_bitwise():
    model = toy_model()
    batch = collate(toy_samples(n=16))
    assert batch.attention_mask.sum(1).unique().numel() > 1  # rows of several lengths: padding
    causal = causal_attention(copy.deepcopy(model))
    assert causal.config._attn_implementation == CAUSAL_SDPA
    real = batch.attention_mask.bool()
    want, got = (
        logits(model, batch.input_ids, batch.attention_mask),
        logits(causal, batch.input_ids, batch.attention_mask),
    )
    assert torch.equal(want[real], got[real])
    full = torch.ones_like(batch.input_ids[:, :4])  # no padding: transformers skips the mask too
    assert torch.equal(logits(model, batch.input_ids[:, :4], full), logits(causal, batch.input_ids[:, :4], full))


def test_trainer_forward_reads_nothing_from_the_device(monkeypatch):
    trainer = Trainer(toy_model(), toy_settings())
    assert trainer.model.config._attn_implementation == CAUSAL_SDPA
    batch = collate(toy_samples(n=8))
    reads = []
    original = torch.Tensor.__bool__

    def counted(tensor):
        reads.append(sys._getframe(1).f_code.co_filename)
        return original(tensor)

    monkeypatch.setattr(torch.Tensor, "__bool__", counted)
    logits(trainer.model, batch.input_ids, batch.attention_mask)
    assert reads == []
