"""The torch engine's prefill budget: newcomers are prefilled in left-padded batches of at most
``max_num_batched_tokens`` tokens (rows x longest), whole sequences each, one longer than the
budget alone, at admission and again when a ``continue`` interrupt re-prefills running requests."""

from __future__ import annotations

import pytest

from flash.engine.torch_engine import TorchEngine, prefill_chunks
from tests.helpers.engine import PROMPTS, make_model, req

MIXED = PROMPTS + [[3] * 20, list(range(1, 30)), [7, 7]]  # prefixes of 2, 0, 6, 11, 19, 28, 1 tokens


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_prefill_chunks_fill_the_budget_in_order():
    assert prefill_chunks([2, 0, 6, 11, 19, 28, 1], 16) == [(0, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7)]
    assert prefill_chunks([4, 4, 4, 4, 5], 12) == [(0, 3), (3, 5)]  # 3 x 4 = 12, then 2 x 5 = 10
    assert prefill_chunks([4, 4, 4, 4, 5], 10**9) == [(0, 5)]
    assert prefill_chunks([40, 1, 1], 8) == [(0, 1), (1, 3)]  # longer than the budget: alone
    assert prefill_chunks([0, 0, 0], 1) == [(0, 3)]  # empty prefixes cost nothing


def run(model, budget: int) -> tuple[list, list[tuple[int, int]]]:
    """Outputs of MIXED (greedy, sampled, nucleus), with a ``continue`` interrupt after 3 steps
    (same weights pushed again: every running request is re-prefilled with its partial response),
    and the (rows, width) of every prefill forward."""
    engine = TorchEngine(model, max_num_seqs=8, max_num_batched_tokens=budget)
    for i, p in enumerate(MIXED):
        engine.add_request(req(f"r{i}", p, n=10, temperature=0.0 if i % 3 == 0 else 0.9, top_p=0.8 if i % 2 else 1.0))
    shapes: list[tuple[int, int]] = []

    def record(module, args, kw):  # a prefill writes into an empty window of the cache
        if kw["past_key_values"].get_seq_length() == 0:
            shapes.append(tuple(kw["input_ids"].shape))

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    done = {}
    for _ in range(3):
        done.update((o.request_id, o) for o in engine.step())
    engine.preempt("continue")
    engine.update_weights(model.state_dict(), version=0)
    engine.resume()
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step())
    hook.remove()
    return [(done[f"r{i}"].token_ids, done[f"r{i}"].logprobs) for i in range(len(MIXED))], shapes


def test_prefill_forwards_stay_within_the_budget_and_outputs_hold():
    model = make_model(0)
    whole, big = run(model, 10**9)
    chunked, small = run(model, 16)
    assert big == [(7, 28), (7, 31)]  # one forward each: 196 tokens, then 217 after the interrupt
    assert small == [
        (2, 2),
        (1, 6),
        (1, 11),
        (1, 19),
        (1, 28),
        (1, 1),
        (2, 5),
        (1, 9),
        (1, 14),
        (1, 22),
        (1, 31),
        (1, 4),
    ]  # the re-prefill is chunked too
    assert all(rows * width <= 16 or rows == 1 for rows, width in small)
    assert [t for t, _ in chunked] == [t for t, _ in whole]  # every token, sampled ones included
    diff = max(abs(a - b) for (_, la), (_, lb) in zip(chunked, whole) for a, b in zip(la, lb))
    assert 0 < diff < 1e-5  # float32 rounding of another batch shape, nothing more
    assert run(model, 217)[0] == whole  # newcomers that fit the budget: one forward, bit for bit


def test_a_negative_budget_is_refused_and_zero_is_no_budget():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        TorchEngine(make_model(0), max_num_batched_tokens=-1)
    assert prefill_chunks([30, 40, 50], 0) == [(0, 3)]
    assert prefill_chunks([30, 40, 50], 80) == [(0, 2), (2, 3)]
