"""The warm start does not depend on the thread count of the process that builds it: it trains on
``sft.threads`` threads (part of its cache key) and hands the caller's count back afterwards."""

from __future__ import annotations

import dataclasses

import torch
from transformers import AutoModelForCausalLM

from flash.models import TinyModelConfig
from flash.train.sft import SFTConfig, cache_key, warm_start
from flash.recipes.tasks import make_task

MODEL = TinyModelConfig()  # the default recipe's model
SFT = SFTConfig(steps=4, batch_size=64, pool_batches=2, warmup_steps=1, eval_after=False)


def _build(root, sft: SFTConfig, caller_threads: int) -> list[torch.Tensor]:
    before = torch.get_num_threads()
    torch.set_num_threads(caller_threads)
    try:
        out = warm_start(MODEL, sft, make_task("stutter"), root)
        assert torch.get_num_threads() == caller_threads  # the caller's count is handed back
    finally:
        torch.set_num_threads(before)
    return [p.detach().clone() for p in AutoModelForCausalLM.from_pretrained(out).parameters()]


def test_warm_start_trains_on_its_own_thread_count(tmp_path, monkeypatch):
    """Whatever the caller set, training (and the held-out check) run on ``sft.threads``; the
    caller's count is back afterwards; the model is the same bit for bit."""
    import flash.train.sft as sft_mod

    seen: list[int] = []
    real = sft_mod.train_sft
    monkeypatch.setattr(sft_mod, "train_sft", lambda *a: seen.append(torch.get_num_threads()) or real(*a))
    one = _build(tmp_path / "a", SFT, caller_threads=1)
    two = _build(tmp_path / "b", SFT, caller_threads=2)
    three = _build(tmp_path / "c", dataclasses.replace(SFT, threads=1), caller_threads=2)
    assert seen == [2, 2, 1]
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert len(three) == len(one)


def test_thread_count_is_in_the_cache_key():
    task = make_task("stutter")
    assert cache_key(MODEL, SFT, task) != cache_key(MODEL, dataclasses.replace(SFT, threads=1), task)
