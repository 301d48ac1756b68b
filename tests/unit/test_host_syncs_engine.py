"""Host reads per torch-engine step: one, the sampled tokens and logprobs, whatever the batch.

Every host read of a tensor (``item``, ``float``, ``int``, ``bool``, ``tolist``, ``cpu``) is
counted by wrapping those ``torch.Tensor`` methods, from every caller, transformers' mask code
included; on a GPU each is a device sync. Counted over steps that admit newcomers (chunked
prefills among them), decode steps over left-padded and unpadded batches, greedy, sampled and
top-p rows, and steps where rows finish and leave.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from flash.engine.torch_engine import TorchEngine
from tests.helpers.host_reads import READS, Counter
from tests.helpers.engine import PROMPTS, make_model, req


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def reads_per_step(monkeypatch, engine: TorchEngine, late: list) -> list[list[str]]:
    """The counted reads of each step until the engine is idle; ``late`` joins at the third step."""
    counter = Counter()
    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counter.wrap(name))
    steps = []
    while engine.has_unfinished():
        if len(steps) == 2:
            for r in late:
                engine.add_request(r)
        counter.calls, counter.on = [], True
        engine.step()
        counter.on = False
        steps.append(counter.calls)
    monkeypatch.undo()
    return steps


def test_one_host_read_per_step_over_padded_batches(monkeypatch):
    engine = TorchEngine(make_model(0), max_num_seqs=3, max_num_batched_tokens=8)
    for i, p in enumerate(PROMPTS):  # 3 run, 1 waits: rows finish, a newcomer fills the slot
        engine.add_request(
            req(f"r{i}", p, n=4 + 2 * i, temperature=[0.0, 0.9, 1.0, 0.7][i], top_p=0.8 if i == 2 else 1.0)
        )
    steps = reads_per_step(monkeypatch, engine, [req("late", [2, 3, 4, 5, 6], n=5, temperature=1.2)])
    assert len(steps) == 14
    assert all(len(calls) == 1 and calls[0].startswith("tolist at ") for calls in steps), steps


def test_one_host_read_per_step_without_padding(monkeypatch):
    engine = TorchEngine(make_model(0), max_num_seqs=4)
    for i in range(3):  # equal lengths: no padding anywhere, the mask is left to SDPA's causal flag
        engine.add_request(req(f"s{i}", [5, 6, 7, 8], n=6, temperature=0.8))
    steps = reads_per_step(monkeypatch, engine, [])
    assert [len(calls) for calls in steps] == [1] * 6, steps


def test_sliding_window_layers_keep_the_2d_mask(monkeypatch):
    """A model with other than full-attention layers gets the 2D mask (transformers builds each
    layer type's mask, reading it): batched tokens are still those of each request alone, and a
    decode step reads 1 + 2 (the full and the sliding mask's padding checks)."""
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        initializer_range=0.2,
        max_position_embeddings=256,
        use_sliding_window=True,
        sliding_window=512,
        max_window_layers=1,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    assert cfg.layer_types == ["full_attention", "sliding_attention"]
    alone = [TorchEngine(model).generate([req("x", p, n=6)])[0].token_ids for p in PROMPTS]
    engine = TorchEngine(model, max_num_seqs=4)
    for i, p in enumerate(PROMPTS):
        engine.add_request(req(f"p{i}", p, n=6))
    steps = reads_per_step(monkeypatch, engine, [])
    assert [len(calls) for calls in steps[1:]] == [3] * 5, steps
    batched = TorchEngine(model, max_num_seqs=4).generate([req(f"q{i}", p, n=6) for i, p in enumerate(PROMPTS)])
    assert [o.token_ids for o in batched] == alone
