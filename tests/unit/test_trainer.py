"""Trainer: logprobs layout, micro-batching equals the full batch, config knobs reach the loss."""

import copy

import pytest
import torch

from flash.buffers import Sample
from flash.train.batch import collate
from flash.train.trainer import Trainer
from tests.helpers.train import toy_model
from tests.helpers.train import toy_samples as samples
from tests.helpers.train import toy_settings as settings


@pytest.fixture(scope="module")
def model():
    return toy_model()


def test_collate_aligns_response_tokens_with_target_columns():
    s = Sample(
        prompt_id=0,
        sample_index=0,
        prompt_ids=[5, 6, 7],
        response_ids=[8, 9],
        behav_logprobs=[-0.5, -0.25],
        versions=[1, 2],
    )
    b = collate([s])
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9]]
    assert b.mask.tolist() == [[0, 0, 1, 1]]  # column j predicts token j+1
    assert b.behav_logp.tolist() == [[0, 0, -0.5, -0.25]]
    assert b.versions.tolist() == [[0, 0, 1, 2]]


def test_logprobs_match_manual_forward(model):
    tr = Trainer(copy.deepcopy(model), settings())
    batch = collate(samples())
    lp = tr.logprobs(batch)
    s = samples()[3]
    seq = torch.tensor([s.prompt_ids + s.response_ids])
    logits = model(input_ids=seq).logits[0, :-1] / 0.7
    manual = torch.log_softmax(logits, -1).gather(-1, seq[0, 1:, None])[:, 0]
    first = len(s.prompt_ids) - 1
    got = lp[3, first : first + len(s.response_ids)]
    assert torch.allclose(got, manual[first:], atol=1e-5)
    assert float(lp[3, :first].abs().sum()) == 0.0  # prompt columns are masked out


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batches_give_the_full_batch_update(model, agg):
    batch = collate(samples())
    adv = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(1)) * batch.mask
    results = []
    for mb in (64, 4, 1):
        tr = Trainer(copy.deepcopy(model), settings(micro_batch_size=mb, agg=agg))
        m = tr.train_step(batch, adv, batch.behav_logp)
        # compare accumulated gradients (Adam's first step is ~lr*sign(g): too coarse a witness)
        results.append((m["loss"], [p.grad.detach().clone() for p in tr.model.parameters()]))
    for loss, grads in results[1:]:
        assert loss == pytest.approx(results[0][0], rel=1e-5, abs=1e-6)
        for a, b in zip(grads, results[0][1]):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    assert sum(float(g.abs().sum()) for g in results[0][1]) > 0


def test_loss_knobs_in_recipe_yaml_reach_the_loss(model, tmp_path):
    """ppo (clipping against the passed prox: old_policy prox) with a tiny clip range set in YAML
    clips most tokens after one step; 0.2 clips fewer.

    The knob travels recipe YAML -> load_config -> trainer_settings -> Trainer -> policy_loss; a
    layer that dropped it would leave both runs at the default and the assertions would fail.
    """
    from flash.app.config import load_config
    from flash.app.settings import trainer_settings

    batch = collate(samples())
    adv = torch.ones(batch.mask.shape) * batch.mask
    clipfrac = {}
    for clip in (0.2, 1e-4):
        recipe = tmp_path / f"r{clip}.yaml"
        recipe.write_text(
            f"train: {{lr: 3.0e-4}}\nrollout: {{temperature: 0.7}}\n"
            f"algo:\n  loss: {{name: ppo, clip_low: {clip}, clip_high: {clip}, "
            f"old_policy: prox}}\n"
        )
        s = trainer_settings(load_config(recipe))
        assert s.loss == {"name": "ppo", "clip_low": clip, "clip_high": clip, "old_policy": "prox"}
        tr = Trainer(copy.deepcopy(model), s)
        prox = tr.logprobs(batch)
        tr.train_step(batch, adv, prox)  # moves the policy away from prox
        m = tr.train_step(batch, adv, prox)
        clipfrac[clip] = m["clipfrac"]
    assert clipfrac[1e-4] > 0.5
    assert clipfrac[1e-4] > clipfrac[0.2]


def test_fused_proximal_equals_a_separate_recompute(model):
    """prox_logp=None (sg(logp) of the step's own forward) == prox from a forward before the step."""
    batch = collate(samples())
    batch.behav_logp = batch.behav_logp - 0.3 * batch.mask  # behaviour policy differs from current
    adv = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(2)) * batch.mask
    grads = []
    for fused in (False, True):
        tr = Trainer(copy.deepcopy(model), settings(loss={"name": "decoupled_ppo"}, micro_batch_size=4))
        prox = None if fused else tr.logprobs(batch)
        m = tr.train_step(batch, adv, prox)
        grads.append((m["loss"], [p.grad.clone() for p in tr.model.parameters()], m))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-6)
    for a, b in zip(grads[0][1], grads[1][1]):
        assert torch.allclose(a, b, atol=1e-7, rtol=1e-5)
    # the fused path reports the train–inference mismatch on tokens of the current version (0)
    assert grads[1][2]["mismatch_mean"] > 0.2 and "mismatch_mean" not in grads[0][2]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_stream_parts_in_any_order_equal_the_full_batch_step(model, agg):
    """The stream trainer's update (groups backpropagated one by one, in finish order, one optimizer
    step at the end) equals the plain step on the whole batch, for every aggregation."""
    from flash import algos
    from flash.train.batch import flatten
    from flash.buffers import Group

    group_list = [Group(prompt_id=g, samples=[s for s in samples(n=8) if s.prompt_id == g]) for g in range(4)]
    whole = collate(flatten(group_list))
    # SGD: Adam's first step is lr·sign(g), which turns float-order noise on a ~0 gradient into a
    # full step; SGD shows the update itself, which is what must be equal
    plain = Trainer(copy.deepcopy(model), settings(agg=agg, loss={"name": "ppo"}))
    plain.optimizer = torch.optim.SGD(plain.model.parameters(), lr=1.0)
    m_plain = plain.train_step(
        whole, algos.compute_advantages("grpo", whole.rewards, whole.group_ids, whole.mask), whole.behav_logp
    )
    stream = Trainer(copy.deepcopy(model), settings(agg=agg, loss={"name": "ppo"}))
    stream.optimizer = torch.optim.SGD(stream.model.parameters(), lr=1.0)
    stream.begin_step()
    for g in (2, 0, 3, 1):  # the order groups happened to finish in
        part = collate(flatten([group_list[g]]))
        stream.accumulate(
            part, algos.compute_advantages("grpo", part.rewards, part.group_ids, part.mask), part.behav_logp
        )
    m_stream = stream.finish_step()
    assert m_stream["loss"] == pytest.approx(m_plain["loss"], rel=1e-5, abs=1e-7)
    assert m_stream["grad_norm"] == pytest.approx(m_plain["grad_norm"], rel=1e-5)
    for a, b in zip(plain.model.parameters(), stream.model.parameters()):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
    moved = sum(float((a - b).abs().sum()) for a, b in zip(plain.model.parameters(), model.parameters()))
    assert moved > 0  # the step did change the weights


def not_bf16_rounded(t: torch.Tensor) -> bool:
    """Some value of ``t`` is not a bfloat16 number: it was computed in a wider type."""
    return bool((t != t.bfloat16().float()).any())


def test_bfloat16_trainer_computes_in_bfloat16_and_keeps_float32_weights_and_state(model):
    """model.dtype bfloat16: the forward's matmuls run in bf16 (autocast), the weights and AdamW
    moments stay fp32, logprobs are fp32 (not bf16-rounded), and the loss is the fp32 loss to bf16
    precision; float32 runs no autocast at all."""
    batch = collate(samples())
    adv = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(3)) * batch.mask
    runs = {}
    for dtype in ("float32", "bfloat16"):
        tr = Trainer(copy.deepcopy(model), settings(dtype=dtype))
        seen = []
        tr.model.model.layers[0].mlp.down_proj.register_forward_hook(
            lambda m, i, out, seen=seen: seen.append(out.dtype)
        )
        lp = tr.logprobs(batch)
        m = tr.train_step(batch, adv, batch.behav_logp)
        runs[dtype] = (tr, set(seen), lp, m)
    tr32, seen32, lp32, m32 = runs["float32"]
    tr16, seen16, lp16, m16 = runs["bfloat16"]
    assert tr32.autocast is None and seen32 == {torch.float32}
    assert seen16 == {torch.bfloat16}
    assert lp16.dtype == torch.float32 and not_bf16_rounded(lp16 * batch.mask)
    assert float(((lp16 - lp32).abs() * batch.mask).max()) < 0.1  # bf16 logits: ~2-3 digits
    assert {p.dtype for p in tr16.model.parameters()} == {torch.float32}
    moments = [v for state in tr16.optimizer.state.values() for k, v in state.items() if k != "step"]
    assert moments and {v.dtype for v in moments} == {torch.float32}
    assert m16["loss"] == pytest.approx(m32["loss"], rel=3e-2) and m16["loss"] != m32["loss"]


def test_float32_logprobs_are_the_plain_forward_bit_for_bit(model):
    """model.dtype float32 (the default): no autocast, no cast: the trainer's logprobs are exactly
    the plain fp32 forward's."""
    batch = collate(samples())
    tr = Trainer(copy.deepcopy(model), settings(dtype="float32"))
    with torch.no_grad():
        logits = tr.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1] / 0.7
    want = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0] * batch.mask
    assert torch.equal(tr.logprobs(batch), want)
