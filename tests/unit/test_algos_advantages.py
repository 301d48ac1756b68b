"""Advantage estimators against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from flash import algos
from flash.algos import compute_advantages

F64 = torch.float64


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


# Three groups with non-contiguous ids: 7 -> rewards [1, 0, 0]; 3 -> [0.5, 0.5] (zero std);
# 9 -> [2.0] (a group of one). Interleaved on purpose.
REWARDS = [1.0, 0.5, 0.0, 0.5, 0.0, 2.0]
GROUPS = [7, 3, 7, 3, 7, 9]
MASK2 = torch.ones(6, 2, dtype=F64)


def per_sample(adv: torch.Tensor) -> list[float]:
    assert torch.equal(adv[:, 0], adv[:, 1])  # constant over tokens
    return adv[:, 0].tolist()


def test_grpo_by_hand():
    adv = compute_advantages("grpo", REWARDS, GROUPS, MASK2)
    # group 7: mean 1/3, unbiased var ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3, std 0.57735
    std = math.sqrt(1 / 3)
    hand = [(2 / 3) / std, 0.0, (-1 / 3) / std, 0.0, (-1 / 3) / std, 0.0]
    assert per_sample(adv) == pytest.approx(hand, rel=1e-5)


def test_grpo_zero_std_group_is_zero_not_nan():
    adv = compute_advantages("grpo", [0.5, 0.5, 0.5], [1, 1, 1], torch.ones(3, 4))
    assert torch.equal(adv, torch.zeros(3, 4))


def test_grpo_eps_reaches_the_estimator():
    adv = compute_advantages("grpo", [1.0, 0.0], [0, 0], torch.ones(2, 1, dtype=F64), eps=1.0)
    std = math.sqrt(0.5)  # unbiased std of [1, 0]
    assert adv[:, 0].tolist() == pytest.approx([0.5 / (std + 1), -0.5 / (std + 1)])


def test_dr_grpo_by_hand():
    adv = compute_advantages("dr_grpo", REWARDS, GROUPS, MASK2)
    assert per_sample(adv) == pytest.approx([2 / 3, 0.0, -1 / 3, 0.0, -1 / 3, 0.0])


def test_rloo_by_hand():
    adv = compute_advantages("rloo", REWARDS, GROUPS, MASK2)
    # group 7: 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5 (twice); group 3: 0; group of one: 0
    assert per_sample(adv) == pytest.approx([1.0, 0.0, -0.5, 0.0, -0.5, 0.0])
    adv = compute_advantages("rloo", [3.0, 1.0], [0, 0], torch.ones(2, 1, dtype=F64))
    assert adv[:, 0].tolist() == pytest.approx([2.0, -2.0])


MASK_RAGGED = [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]


def test_reinforce_pp_by_hand():
    adv = compute_advantages("reinforce_pp", [1.0, 0.0], [0, 1], t(MASK_RAGGED))
    # returns [[1, 1, -], [0, 0, 0]]: mean 0.4, population std sqrt(0.24)
    hi, lo = 0.6 / math.sqrt(0.24), -0.4 / math.sqrt(0.24)
    torch.testing.assert_close(adv, t([[hi, hi, 0.0], [lo, lo, lo]]), rtol=1e-5, atol=1e-6)


def test_reinforce_pp_discount_by_hand():
    adv = compute_advantages("reinforce++", [1.0, 0.0], [0, 1], t(MASK_RAGGED), gamma=0.5)
    # returns [[0.5, 1, -], [0, 0, 0]]: mean 0.3, var (0.04 + 0.49 + 3 * 0.09) / 5 = 0.16
    torch.testing.assert_close(adv, t([[0.5, 1.75, 0.0], [-0.75, -0.75, -0.75]]), rtol=1e-5, atol=1e-5)


def test_reinforce_pp_group_baseline_by_hand():
    adv = compute_advantages("reinforce_pp", [1.0, 0.0], [0, 0], t(MASK_RAGGED), group_baseline=True)
    # r - group mean = [0.5, -0.5]; returns [[.5, .5, -], [-.5, -.5, -.5]]: mean -0.1, var 0.24
    hi, lo = 0.6 / math.sqrt(0.24), -0.4 / math.sqrt(0.24)
    torch.testing.assert_close(adv, t([[hi, hi, 0.0], [lo, lo, lo]]), rtol=1e-5, atol=1e-6)
    # With one group, a common shift cancels in the batch normalisation; with two groups whose
    # means differ, the baseline changes the result.
    mask3 = t(MASK_RAGGED + [[1.0, 0.0, 0.0]])
    shifted = compute_advantages("reinforce_pp", [1.0, 0.0, 5.0], [0, 0, 1], mask3, group_baseline=True)
    unshifted = compute_advantages("reinforce_pp", [1.0, 0.0, 5.0], [0, 0, 1], mask3)
    assert not torch.allclose(shifted, unshifted)


def test_gae_by_hand():
    mask = t([[1, 1, 1, 0], [1, 0, 1, 0]])
    values = t([[0.5, 0.2, 0.1, 5.0], [0.3, 9.0, 0.4, 7.0]])
    adv = compute_advantages("gae", [1.0, 2.0], [0, 1], mask, values=values, gamma=0.9, lam=0.8)
    # row 0: d2 = 1 - 0.1 = 0.9; d1 = 0.9*0.1 - 0.2 = -0.11; d0 = 0.9*0.2 - 0.5 = -0.32
    #        A2 = 0.9, A1 = -0.11 + 0.72*0.9 = 0.538, A0 = -0.32 + 0.72*0.538 = 0.06736
    # row 1: token 1 is masked out and skipped: d2 = 2 - 0.4 = 1.6, d0 = 0.9*0.4 - 0.3 = 0.06,
    #        A0 = 0.06 + 0.72*1.6 = 1.212
    hand = t([[0.06736, 0.538, 0.9, 0.0], [1.212, 0.0, 1.6, 0.0]])
    torch.testing.assert_close(adv, hand)
    _, returns = algos.gae_advantages_and_returns(t([[0, 0, 1.0, 0], [0, 0, 2.0, 0]]), values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(returns, t([[0.56736, 0.738, 1.0, 0], [1.512, 0, 2.0, 0]]))


def test_gae_defaults_are_monte_carlo():
    # gamma = lam = 1: A_t = R - V_t
    mask = t([[1, 1, 1]])
    adv = compute_advantages("gae", [1.0], [0], mask, values=t([[0.5, 0.2, 0.1]]))
    torch.testing.assert_close(adv, t([[0.5, 0.8, 0.9]]))


def test_gae_token_level_rewards():
    mask = t([[1, 1, 1]])
    adv = compute_advantages("gae", t([[0.5, 0.0, 1.0]]), [0], mask, values=t([[0, 0, 0.0]]))
    torch.testing.assert_close(adv, t([[1.5, 1.0, 1.0]]))


def test_gae_needs_values():
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", [1.0], [0], torch.ones(1, 2))


def test_token_rewards_rejected_by_group_estimators():
    with pytest.raises(ValueError, match="gae"):
        compute_advantages("grpo", torch.ones(2, 3), [0, 0], torch.ones(2, 3))


def test_clip_and_whiten():
    adv = compute_advantages("dr_grpo", REWARDS, GROUPS, MASK2, clip=0.5)
    assert per_sample(adv) == pytest.approx([0.5, 0.0, -1 / 3, 0.0, -1 / 3, 0.0])
    mask = t([[1, 1, 0], [1, 0, 0]])
    adv = compute_advantages("dr_grpo", [2.0, 0.0], [0, 0], mask, whiten=True)
    # dr_grpo: [[1, 1, -], [-1, -, -]]; masked mean 1/3, population std sqrt(8/9)
    hi, lo = (1 - 1 / 3) / math.sqrt(8 / 9), (-1 - 1 / 3) / math.sqrt(8 / 9)
    torch.testing.assert_close(adv, t([[hi, hi, 0], [lo, 0, 0]]), rtol=1e-6, atol=1e-7)


def test_masked_tokens_are_zero():
    mask = t([[1, 0, 1], [0, 0, 1]])
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp"):
        adv = compute_advantages(name, [1.0, 0.0], [0, 0], mask)
        assert torch.all(adv[mask == 0] == 0), name
        assert torch.any(adv[mask > 0] != 0), name


def test_every_builtin_estimator_is_tested():
    assert {r["name"] for r in algos.describe_advantages()} == {"grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"}


def test_estimator_errors_name_the_closest():
    with pytest.raises(ValueError, match="'grpo'"):
        compute_advantages("grpoo", [1.0], [0], torch.ones(1, 1))
    with pytest.raises(ValueError, match="'whiten'"):
        algos.validate_advantage("grpo", {"whitten": True})
    with pytest.raises(ValueError, match="lam"):
        algos.validate_advantage("gae", {"lam": 1.5})
    with pytest.raises(ValueError, match="gamma"):
        algos.validate_advantage("reinforce++", {"gamma": 2.0})
    with pytest.raises(ValueError, match="clip"):
        algos.validate_advantage("rloo", {"clip": -1.0})
    with pytest.raises(ValueError, match="bool"):
        algos.validate_advantage("rloo", {"whiten": "yes"})
    algos.validate_advantage("gae", {"gamma": 0.99, "lam": 0.95, "whiten": True, "clip": 5})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("value", [0.7, 2 / 3, 0.1, 1e-3, 123.456])
@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_a_group_of_equal_rewards_gets_exactly_zero_in_any_dtype(dtype, value, name):
    """Group statistics run in float64 on rewards shifted by the group's first: no rounding
    residue divided by a tiny std (float32 arithmetic gives up to ~0.1 here)."""
    mask = torch.ones(8, 3, dtype=dtype)
    rewards = torch.full((8,), value, dtype=dtype)
    adv = (
        compute_advantages(name, rewards, [0] * 5 + [1] * 3, mask, eps=1e-6)
        if name == "grpo"
        else compute_advantages(name, rewards, [0] * 5 + [1] * 3, mask)
    )
    assert adv.dtype == dtype
    assert torch.equal(adv, torch.zeros(8, 3, dtype=dtype))


def test_grpo_float32_matches_float64_to_rounding():
    rewards = [0.7, 0.7, 0.1, 2 / 3, 0.0, 1.0]
    a32 = compute_advantages("grpo", rewards, [0, 0, 0, 1, 1, 1], torch.ones(6, 1))
    a64 = compute_advantages("grpo", rewards, [0, 0, 0, 1, 1, 1], torch.ones(6, 1, dtype=F64))
    assert a32.dtype == torch.float32
    # group 0: mean 0.5, unbiased std sqrt(0.12) = 0.34641; 0.2 / 0.34641 = 0.57735
    assert a64[:, 0].tolist()[:3] == pytest.approx([0.57735, 0.57735, -1.15470], abs=1e-4)
    torch.testing.assert_close(a32.double(), a64, rtol=1e-6, atol=1e-6)


def test_whiten_unbiased_divides_by_the_bessel_corrected_std():
    mask = t([[1, 1, 0], [1, 0, 0]])
    adv = compute_advantages("dr_grpo", [2.0, 0.0], [0, 0], mask, whiten=True, whiten_unbiased=True)
    # dr_grpo: [[1, 1, -], [-1, -, -]]; masked mean 1/3, squares sum 8/3, n - 1 = 2: std sqrt(4/3)
    hi, lo = (2 / 3) / math.sqrt(4 / 3), (-4 / 3) / math.sqrt(4 / 3)
    torch.testing.assert_close(adv, t([[hi, hi, 0], [lo, 0, 0]]), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="whiten: true"):
        algos.validate_advantage("grpo", {"whiten_unbiased": True})
    adv32 = compute_advantages("dr_grpo", [2.0, 0.0], [0, 0], mask.float(), whiten=True)
    assert adv32.dtype == torch.float32
