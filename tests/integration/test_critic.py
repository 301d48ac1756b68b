"""The critic role for ``gae``: the clipped value loss on hand-computed values, GAE returns, a
critic that learns on a fixed batch, and a recipe that trains with ``gae`` end to end."""

import json
import textwrap

import pytest
import ray
import torch

from flash import algos
from flash.algos.value import value_loss
from flash.train.batch import collate
from flash.train.critic import Critic, CriticSettings
from flash.models import TinyModelConfig, build_tiny_model, build_tokenizer
from flash.buffers.types import Sample


def test_value_loss_hand_computed_with_and_without_the_clip():
    # token 0: err (1-2)^2 = 1; clipped value 0.5 + 0.2 = 0.7, err 1.69 -> max 1.69, clip engaged
    # token 1: err (2-1)^2 = 1; clipped value 2.5 - 0.2 = 2.3, err 1.69 -> max 1.69, clip engaged
    # token 2 (masked out) must not count
    values = torch.tensor([[1.0, 2.0, 9.0]], requires_grad=True)
    old, ret, mask = torch.tensor([[0.5, 2.5, 0.0]]), torch.tensor([[2.0, 1.0, 0.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    loss, m = value_loss(values, old, ret, mask, clip=0.2)
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * 1.69) and m["critic/clipfrac"] == 1.0
    assert values.grad.tolist() == [[0.0, 0.0, 0.0]]  # the clipped branch is flat in V
    # inside the clip range the loss is 0.5 (V - R)^2 and its gradient (V - R) / n_tokens
    values = torch.tensor([[0.6, 1.1]], requires_grad=True)
    loss, m = value_loss(values, torch.tensor([[0.5, 1.0]]), torch.tensor([[2.0, 1.0]]), torch.ones(1, 2), clip=0.2)
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * (1.96 + 0.01) / 2) and m["critic/clipfrac"] == 0.0
    assert values.grad[0].tolist() == pytest.approx([(0.6 - 2.0) / 2, (1.1 - 1.0) / 2])
    loss, _ = value_loss(torch.tensor([[1.0]]), torch.tensor([[0.5]]), torch.tensor([[2.0]]), torch.ones(1, 1), None)
    assert loss.item() == pytest.approx(0.5)


def test_gae_returns_are_the_reward_to_go_whatever_the_values():
    """gamma = lam = 1 and a terminal reward: A_t = R - V_t, so returns A_t + V_t = R on every token."""
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.float32)
    values = torch.randn(2, 5) * mask
    rewards = torch.tensor([1.0, -0.5])
    ret = algos.gae_returns(rewards, values, mask)
    assert torch.allclose(ret, rewards[:, None] * mask, atol=1e-6)
    # gamma 0.5, lam 1, zero values: R discounted by the distance to the last token
    ret = algos.gae_returns(rewards, torch.zeros(2, 5), mask, gamma=0.5, lam=1.0)
    assert ret[0].tolist() == pytest.approx([0.0, 0.25, 0.5, 1.0, 0.0])


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    tok = build_tokenizer()
    model = build_tiny_model(
        tok,
        TinyModelConfig(
            hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=64
        ),
    )
    path = tmp_path_factory.mktemp("critic-model")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _batch():
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(8):
        prompt = torch.randint(5, 30, (3,), generator=gen).tolist()
        resp = torch.randint(5, 30, (4 + i % 3,), generator=gen).tolist()
        samples.append(
            Sample(
                prompt_id=i // 2,
                sample_index=i % 2,
                prompt_ids=prompt,
                response_ids=resp,
                behav_logprobs=[-1.0] * len(resp),
                versions=[0] * len(resp),
                reward=float(i % 2),
            )
        )
    return collate(samples)


def test_critic_starts_at_zero_and_learns_the_returns(tiny_path):
    critic = Critic(tiny_path, CriticSettings(lr=3e-3, value_clip=None), seed=0)
    batch = _batch()
    v0 = critic.values(batch)
    assert torch.count_nonzero(v0) == 0  # zero-initialised head: GAE starts as reward-to-go
    returns = algos.gae_returns(batch.rewards, v0, batch.mask)
    first = critic.train_step(batch, returns, v0)
    for _ in range(40):
        last = critic.train_step(batch, returns, critic.values(batch))
    assert first["critic/value_loss"] == pytest.approx(0.5 * float((returns**2).sum() / batch.mask.sum()))
    assert last["critic/value_loss"] < 0.2 * first["critic/value_loss"]
    assert last["critic/explained_var"] > 0.5


def test_recipe_trains_with_gae_and_a_critic(tmp_path):
    from flash.app.config import load_config
    from flash.app.runner import run

    recipe = tmp_path / "gae.yaml"
    recipe.write_text(
        textwrap.dedent(f"""
        description: gae with a critic
        async_ratio: 1
        algo: {{advantage: {{name: gae, gamma: 1.0, lam: 0.95}}, loss: {{name: ppo}}}}
        critic: {{lr: 1e-3}}
        sft: {{steps: 40, eval_after: false}}
        model: {{tiny: {{num_layers: 1}}}}
        train: {{steps: 3, prompts_per_step: 4}}
        rollout: {{n: 4, max_new_tokens: 24}}
        task: {{name: stutter, eval_size: 8}}
        tracking: {{tensorboard: false, progress: false}}
        resources: {{engine_threads: 1, trainer_threads: 1}}
        cache_dir: {tmp_path / "cache"}
        run_dir: {tmp_path / "run"}
    """)
    )
    try:
        summary = run(load_config(recipe), "gae")
    finally:
        if ray.is_initialized():
            ray.shutdown()
    assert summary["steps"] == 3
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for r in rows:  # the critic's step came back with the policy's, every step
        assert r["train/critic/value_loss"] >= 0 and r["train/critic/grad_norm"] >= 0
        assert torch.isfinite(torch.tensor(r["train/critic/values_mean"]))
