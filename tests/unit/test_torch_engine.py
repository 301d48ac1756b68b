"""TorchEngine and EngineLoop on a tiny random Qwen2 (CPU, fp32, a few seconds in all).

The model is built with ``initializer_range=0.2`` so that its greedy continuations vary from token
to token (the default 0.02 soon repeats one token, which would let wrong outputs pass).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from flash.engine import kv_cache
from flash.engine.loop import EngineLoop, EngineLoopError
from flash.engine.torch_engine import TorchEngine
from tests.helpers.engine import PROMPTS, make_model, req

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def model():
    return make_model(0)


@pytest.fixture
def other():
    """A second model with different weights: the 'trainer' pushes these in weight-update tests."""
    return make_model(1)


def hf_greedy(model, prompt, n) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def solo(model, request) -> list[int]:
    return TorchEngine(model).generate([request])[0].token_ids


# ---- TorchEngine -------------------------------------------------------------------------------
def test_greedy_matches_hf_generate_batched(model):
    engine = TorchEngine(model, max_num_seqs=3)  # 4 prompts: one waits, then joins a running batch
    outs = engine.generate([req(f"p{i}", p, n=12) for i, p in enumerate(PROMPTS)])
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == hf_greedy(model, p, 12)
        assert o.finish_reason == "length" and o.versions == [0] * 12 and o.prompt_ids == p
    assert len({tuple(o.token_ids) for o in outs}) == len(PROMPTS)


def test_logprobs_match_teacher_forced_recompute(model):
    reqs = [
        req("a", PROMPTS[0], n=10, temperature=0.7),
        req("b", PROMPTS[2], n=10, temperature=0.7, top_p=0.8),
        req("g", PROMPTS[3], n=10),
    ]
    outs = TorchEngine(model).generate(reqs)
    for r, o in zip(reqs, outs):
        seq = torch.tensor([r.prompt_ids + o.token_ids])
        with torch.no_grad():
            logits = model(seq).logits[0, len(r.prompt_ids) - 1 : -1]
        temp = r.params.temperature or 1.0  # greedy reports the raw-logit distribution
        ref = torch.log_softmax(logits / temp, -1).gather(-1, torch.tensor(o.token_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(o.logprobs), ref, atol=1e-4), (r.request_id, o.logprobs, ref)
    assert min(outs[0].logprobs) < -0.5  # really sampled, not a near-deterministic model


def test_bfloat16_engine_samples_with_float32_logprobs(model):
    """A bf16 model (model.dtype bfloat16): the KV cache is bf16, the logprobs are fp32 (not
    bf16-rounded) and agree with the fp32 log_softmax of the same bf16 model's full forward."""
    bf16 = model.to(torch.bfloat16)
    engine = TorchEngine(bf16)
    r = req("a", PROMPTS[2], n=10, temperature=0.7)
    (o,) = engine.generate([r])
    assert {t.dtype for t in bf16.state_dict().values()} == {torch.bfloat16}
    seq = torch.tensor([r.prompt_ids + o.token_ids])
    with torch.no_grad():
        logits = bf16(seq).logits[0, len(r.prompt_ids) - 1 : -1].float()
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(o.token_ids)[:, None]).squeeze(-1)
    got = torch.tensor(o.logprobs, dtype=torch.float32)
    assert bool((got != got.bfloat16().float()).any())  # computed in fp32, not in bf16
    assert torch.allclose(got, ref, atol=5e-2)  # bf16 forward: cached vs full differ in the last bits


def test_sampling_is_per_request_seeded(model):
    target = req("x", PROMPTS[0], n=16, temperature=1.0)
    alone = solo(model, target)
    engine = TorchEngine(model, max_num_seqs=8)
    engine.add_request(req("o1", PROMPTS[3], n=20, temperature=1.0))
    engine.step()
    engine.step()  # target joins a batch already in flight, with other lengths
    for r in [target, req("o2", PROMPTS[1], n=5, temperature=0.9, top_p=0.7), req("o3", PROMPTS[2], n=30)]:
        engine.add_request(r)
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step())
    assert done["x"].token_ids == alone
    assert solo(model, target) == alone  # reproducible across runs
    assert solo(model, req("y", PROMPTS[0], n=16, temperature=1.0)) != alone  # derived seeds differ by id
    a, b = (req(rid, PROMPTS[0], n=16, temperature=1.0, seed=123) for rid in "ab")
    assert solo(model, a) == solo(model, b) != alone  # an explicit seed wins over the id


def run_steps(engine, max_running):
    """Step to completion; returns {request_id: (step index it finished in, output)}."""
    finished, i = {}, 0
    while engine.has_unfinished():
        i += 1
        finished.update((o.request_id, (i, o)) for o in engine.step())
        assert engine.num_running <= max_running
    return finished


def test_continuous_batching(model):
    engine = TorchEngine(model, max_num_seqs=2)
    reqs = [req(f"r{i}", PROMPTS[i % 4], n=n) for i, n in enumerate([2, 6, 3, 5, 4])]
    for r in reqs:
        engine.add_request(r)
    engine.step()
    assert (engine.num_running, engine.num_waiting) == (2, 3)
    fin = run_steps(engine, max_running=2)
    # r0 ends in step 2 and frees its slot at once: r2 is admitted in step 3 and ends in step 5; r1
    # ends in step 6, so r3 starts in step 6 and r4 in step 7 (FIFO), both ending in step 10.
    assert {rid: i + 1 for rid, (i, _) in fin.items()} == {"r0": 2, "r1": 6, "r2": 5, "r3": 10, "r4": 10}
    for r in reqs:
        assert fin[r.request_id][1].token_ids == hf_greedy(model, r.prompt_ids, r.params.max_new_tokens)


def test_request_added_mid_decode_joins_next_step(model):
    engine = TorchEngine(model, max_num_seqs=4)
    engine.add_request(req("a", PROMPTS[3], n=10))
    for _ in range(3):
        engine.step()
    engine.add_request(req("b", PROMPTS[0], n=4))
    engine.step()
    assert (engine.num_running, engine.num_waiting) == (2, 0)
    fin = run_steps(engine, max_running=2)
    assert fin["b"][0] == 3 and fin["a"][0] == 6  # b joined in step 4: ends in step 7 (= 4 + 3)
    assert fin["b"][1].token_ids == hf_greedy(model, PROMPTS[0], 4)
    assert fin["a"][1].token_ids == hf_greedy(model, PROMPTS[3], 10)


def test_random_arrivals_match_solo_greedy(model, monkeypatch):
    """Requests of random lengths arrive at random steps; slack 1 forces KV rebuilds, swap-removals
    and window moves all the time. Every output must still equal its solo greedy continuation."""
    monkeypatch.setattr(kv_cache, "SLACK", 1)
    rng = torch.Generator().manual_seed(7)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=rng))  # noqa: E731
    reqs = [req(f"q{i}", [draw(0, 63) for _ in range(draw(1, 12))], n=draw(1, 10)) for i in range(12)]
    engine, pending, done = TorchEngine(model, max_num_seqs=3), list(reqs), {}
    while pending or engine.has_unfinished():
        for _ in range(draw(0, 2)):
            if pending:
                engine.add_request(pending.pop(0))
        done.update((o.request_id, o) for o in engine.step())
        assert engine.num_running <= 3
    for r in reqs:
        assert done[r.request_id].token_ids == hf_greedy(model, r.prompt_ids, r.params.max_new_tokens), r


def test_stop_tokens_and_max_new_tokens(model):
    ref = hf_greedy(model, PROMPTS[2], 12)
    k = next(i for i in range(2, 12) if ref[i] not in ref[:i])  # a token first seen at index k >= 2
    stop, length, empty = TorchEngine(model).generate(
        [req("s", PROMPTS[2], n=12, stop_token_ids=[ref[k]]), req("l", PROMPTS[2], n=5), req("e", PROMPTS[2], n=0)]
    )
    assert (stop.token_ids, stop.finish_reason) == (ref[: k + 1], "stop")
    assert (length.token_ids, length.finish_reason) == (ref[:5], "length")
    assert (empty.token_ids, empty.finish_reason) == ([], "length")


def test_abort_returns_partial_outputs(model):
    engine = TorchEngine(model, max_num_seqs=2)
    for rid, p in zip("abc", PROMPTS):
        engine.add_request(req(rid, p, n=10))
    for _ in range(3):
        engine.step()
    (a,) = engine.abort(["a", "unknown"])
    assert (a.token_ids, a.finish_reason, a.versions) == (hf_greedy(model, PROMPTS[0], 3), "abort", [0, 0, 0])
    engine.step()  # c takes a's slot; b goes on undisturbed
    outs = {o.request_id: o for o in engine.abort()}
    assert [len(outs["b"].token_ids), len(outs["c"].token_ids)] == [4, 1]
    assert outs["b"].token_ids == hf_greedy(model, PROMPTS[1], 4) and not engine.has_unfinished()


def test_continue_update_weights_engine(model, other):
    engine = TorchEngine(model)
    engine.add_request(req("a", PROMPTS[2], n=12))
    for _ in range(5):
        engine.step()
    engine.preempt("continue")
    engine.update_weights(other.state_dict(), version=1)
    engine.resume()
    with pytest.raises(RuntimeError, match="idle"):
        engine.generate([])
    out = run_steps(engine, 1)["a"][1]
    assert out.versions == [0] * 5 + [1] * 7 and engine.version == 1
    assert out.token_ids[:5] == hf_greedy(make_model(0), PROMPTS[2], 5)
    assert out.token_ids[5:] == hf_greedy(other, PROMPTS[2] + out.token_ids[:5], 7)


def test_update_weights_rejects_unknown_names(model, other):
    engine = TorchEngine(model)
    with pytest.raises(KeyError, match="did you mean"):
        engine.update_weights({"model.layers.0.mlp.up_proj.weigth": torch.zeros(128, 64)}, version=1)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([("lm_head.weight", torch.zeros(3, 3))], version=1)
    assert engine.version == 0


# ---- EngineLoop --------------------------------------------------------------------------------
def slow_after(engine, n_steps, delay=0.01) -> threading.Event:
    """Make every step after the n-th sleep ``delay`` s; the event fires at the n-th step, so a
    test can pause mid-generation without racing a fast tiny model."""
    reached, count, step = threading.Event(), [0], engine.step

    def slowed():
        out = step()
        count[0] += 1
        if count[0] >= n_steps:
            reached.set()
            time.sleep(delay)
        return out

    engine.step = slowed
    return reached


def collect(loop, n, timeout=30.0) -> dict:
    outs, deadline = {}, time.monotonic() + timeout
    while len(outs) < n and time.monotonic() < deadline:
        outs.update((o.request_id, o) for o in loop.get_finished(timeout=1.0))
    assert len(outs) == n
    return outs


@pytest.fixture
def make_loop():
    loops = []

    def make(engine):
        loops.append(EngineLoop(engine))
        return loops[-1]

    yield make
    for loop in loops:
        loop.shutdown()


def test_loop_pause_continue_update_resume(model, other, make_loop):
    engine = TorchEngine(model)
    reached = slow_after(engine, 4)
    loop = make_loop(engine)
    loop.submit([req("a", PROMPTS[2], n=40)])
    assert reached.wait(10)
    loop.pause("continue")
    k = loop.stats()["tokens_generated"]
    time.sleep(0.05)
    assert loop.stats()["tokens_generated"] == k and loop.get_finished(timeout=0) == []  # parked
    loop.update_weights(other.state_dict(), version=1)
    loop.resume()
    out = collect(loop, 1)["a"]
    k = int(k)
    assert 4 <= k < 40 and out.versions == [0] * k + [1] * (40 - k)
    assert out.token_ids[:k] == hf_greedy(make_model(0), PROMPTS[2], k)
    assert out.token_ids[k:] == hf_greedy(other, PROMPTS[2] + out.token_ids[:k], 40 - k)
    assert loop.stats()["version"] == 1.0


def test_loop_pause_restart_regenerates_at_new_version(model, other, make_loop):
    target = req("a", PROMPTS[0], n=30, temperature=1.0)
    engine = TorchEngine(model)
    reached = slow_after(engine, 3)
    loop = make_loop(engine)
    loop.submit([target])
    assert reached.wait(10)
    loop.pause("restart")
    assert loop.stats()["num_waiting"] == 1.0
    loop.update_weights(other.named_parameters(), version=1)
    loop.resume()
    out = collect(loop, 1)["a"]
    assert out.versions == [1] * 30
    assert out.token_ids == solo(other, target)  # same seed, from scratch, under the new weights
    assert out.token_ids[:3] != solo(make_model(0), target)[:3]


def test_loop_pause_wait_drains_running_only(model, make_loop):
    engine = TorchEngine(model, max_num_seqs=1)
    reached = slow_after(engine, 2)
    loop = make_loop(engine)
    loop.submit([req("a", PROMPTS[0], n=30), req("b", PROMPTS[1], n=4)])
    assert reached.wait(10)
    loop.pause("wait")
    assert [o.request_id for o in loop.get_finished(timeout=0)] == ["a"]  # finished before pause returned
    time.sleep(0.05)
    s = loop.stats()
    assert (s["num_running"], s["num_waiting"], s["tokens_generated"]) == (0.0, 1.0, 30.0)  # b not started
    loop.resume()
    assert collect(loop, 1)["b"].token_ids == hf_greedy(model, PROMPTS[1], 4)
    busy = loop.stats()["busy_s"]
    time.sleep(0.05)
    assert loop.stats()["busy_s"] == busy > 0 and loop.stats()["idle_s"] > 0  # idle: no stepping, no spin


def test_loop_nothing_lost_under_concurrent_pause_cycles(model, other, make_loop):
    """Two submitter threads race against pause/update/resume cycles in every mode: each request
    finishes exactly once, complete, with non-decreasing versions."""
    engine = TorchEngine(model, max_num_seqs=4)
    slow_after(engine, 1, delay=0.002)
    loop = make_loop(engine)
    reqs = [req(f"c{i}", PROMPTS[i % 4], n=5 + i % 7, temperature=1.0) for i in range(24)]

    def submit(part):
        for r in part:
            loop.submit([r])
            time.sleep(0.005)

    threads = [threading.Thread(target=submit, args=(reqs[k::2],)) for k in range(2)]
    for t in threads:
        t.start()
    weights = [make_model(0).state_dict(), other.state_dict()]
    for version, mode in enumerate(["continue", "restart", "wait", "continue"], start=1):
        time.sleep(0.03)
        loop.pause(mode)
        loop.update_weights(weights[version % 2], version)
        loop.resume()
    for t in threads:
        t.join()
    outs, deadline = [], time.monotonic() + 30
    while len(outs) < len(reqs) and time.monotonic() < deadline:
        outs += loop.get_finished(timeout=1.0)
    for o in outs:
        assert len(o.token_ids) == len(o.versions) == 5 + int(o.request_id[1:]) % 7
        assert o.versions == sorted(o.versions) and o.finish_reason == "length"
    assert sorted(o.request_id for o in outs) == sorted(r.request_id for r in reqs)  # each exactly once
    assert loop.get_finished(timeout=0.05) == []


def test_loop_update_weights_needs_pause_and_abort(model, other, make_loop):
    engine = TorchEngine(model)
    slow_after(engine, 1, delay=0.005)
    loop = make_loop(engine)
    with pytest.raises(RuntimeError, match="paused"):
        loop.update_weights(other.state_dict(), version=1)
    loop.submit([req("a", PROMPTS[0], n=200)])
    (a,) = loop.abort()
    assert a.finish_reason == "abort" and len(a.token_ids) < 200 and loop.stats()["version"] == 0.0


def test_loop_thread_error_surfaces(model):
    engine = TorchEngine(model)

    def broken_step():
        raise ValueError("boom")

    engine.step = broken_step
    loop = EngineLoop(engine)
    loop.submit([req("a", PROMPTS[0])])
    with pytest.raises(EngineLoopError) as info:
        loop.get_finished(timeout=10)
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(EngineLoopError):
        loop.submit([req("b", PROMPTS[0])])
    loop.shutdown()  # already reported: shutdown stays quiet


def test_level2_sleep_discards_weights_until_a_full_push():
    """After sleep(2) the weights are gone: resume is refused until every tensor was pushed again."""
    from flash.models import TinyModelConfig, build_tiny_model, build_tokenizer
    from flash.engine.torch_engine import TorchEngine

    tok = build_tokenizer()
    model = build_tiny_model(
        tok,
        TinyModelConfig(
            hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=64
        ),
    )
    state = {k: v.clone() for k, v in model.state_dict().items()}
    engine = TorchEngine(model, max_num_seqs=2)
    engine.preempt("continue")
    info = engine.sleep(2)
    assert info["weights"] == "discarded" and all(t.numel() == 0 for t in model.state_dict().values())
    engine.wake_up()
    names = sorted(state)
    engine.update_weights({n: state[n] for n in names[:-1]}, 1)
    with pytest.raises(RuntimeError, match=r"1 missing, e.g. '" + names[-1].replace(".", r"\.")):
        engine.resume()
    engine.update_weights({names[-1]: state[names[-1]]}, 1)
    engine.resume()
    assert all(torch.equal(model.state_dict()[n], state[n]) for n in names)


def test_kv_cache_is_sized_to_the_run_not_to_max_num_seqs(model):
    """4 requests (prompts of 1-12 tokens, 10 new tokens) on an engine of 256 slots: the KV
    buffers hold 4 rows and the columns the requests can need (the longest prefix, then 10 new
    tokens or SLACK spare columns), allocated once: no regrowth while they decode."""
    engine = TorchEngine(model, max_num_seqs=256)
    for i, p in enumerate(PROMPTS):
        engine.add_request(req(f"r{i}", p, n=10))
    want = (4, max(len(p) - 1 for p in PROMPTS) + max(10, kv_cache.SLACK))
    shapes = set()
    while engine.has_unfinished():
        engine.step()
        if engine._kv is not None:
            shapes.add((engine._kv.rows, engine._kv.capacity))
            assert {tuple(layer.k_buf.shape) for layer in engine._kv.layers} == {(4, 2, want[1], 32)}
    assert shapes == {want}


def test_kv_rebuild_moves_the_window_in_place_when_it_fits(model, monkeypatch):
    """When the window reaches the buffers' last column after a long row left, it moves left inside
    the same buffers (no new allocation); every output still equals its solo greedy continuation."""
    monkeypatch.setattr(kv_cache, "SLACK", 1)
    engine = TorchEngine(model, max_num_seqs=4)
    engine.add_request(req("long", PROMPTS[3], n=3))
    engine.add_request(req("short", PROMPTS[1], n=12))
    done = {o.request_id: o for o in engine.step()}
    buffers = [layer.k_buf for layer in engine._kv.layers]
    while "long" not in done:
        done.update((o.request_id, o) for o in engine.step())
    engine.add_request(req("late", PROMPTS[0], n=12))
    starts = []
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step())
        if engine._kv is not None:
            starts.append(engine._kv.start)
            assert all(layer.k_buf is buf for layer, buf in zip(engine._kv.layers, buffers))  # in place
    assert any(b < a for a, b in zip(starts, starts[1:]))  # the window moved left inside them
    for rid, p, n in (("long", PROMPTS[3], 3), ("short", PROMPTS[1], 12), ("late", PROMPTS[0], 12)):
        assert done[rid].token_ids == hf_greedy(model, p, n), rid
