"""Policy losses against hand-computed values (forward and gradient), per aggregation mode, and
the identities between losses (e.g. decoupled PPO at prox = behav is PPO).

The fixture: 2 samples x 3 tokens, mask [[1, 1, 0], [1, 1, 1]] (token (0, 2) is padding), built
from three hand-picked ratio tables so every value below can be checked on paper:

    Q = pi_prox / pi_behav = [[1.0, 2.0, 3.0], [0.5, 1.0, 8.0]]
    R = pi / pi_prox       = [[1.5, 0.7, 2.0], [0.9, 1.1, 1.3]]
    R_behav = Q * R        = [[1.5, 1.4, 6.0], [0.45, 1.1, 10.4]]
    A                      = [[1.0, -1.0, 2.0], [-2.0, 0.5, -1.0]]

The padding token has ratios far from 1, so a loss or metric that forgets the mask shows it.
Table entries at (0, 2) are marked PAD: their weight in every aggregation is 0.
"""

from __future__ import annotations

import math

import pytest
import torch

from flash import algos
from flash.algos import LossInputs, policy_loss

F64 = torch.float64
BEHAV = [[-1.0, -2.0, -0.5], [-1.5, -0.3, -2.5]]
Q = [[1.0, 2.0, 3.0], [0.5, 1.0, 8.0]]
R = [[1.5, 0.7, 2.0], [0.9, 1.1, 1.3]]
A = [[1.0, -1.0, 2.0], [-2.0, 0.5, -1.0]]
MASK = [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
# logp = behav + ln(Q * R), by hand
LOGP = [
    [-1.0 + math.log(1.5), -2.0 + math.log(1.4), -0.5 + math.log(6.0)],
    [-1.5 + math.log(0.45), -0.3 + math.log(1.1), -2.5 + math.log(10.4)],
]

# d(aggregate)/d(per-token term), by hand, per mode (B = 2, n = [2, 3], N = 5, T = 3)
AGG_WEIGHTS = {
    "token-mean": [[1 / 5, 1 / 5, 0], [1 / 5, 1 / 5, 1 / 5]],
    "seq-mean-token-mean": [[1 / 4, 1 / 4, 0], [1 / 6, 1 / 6, 1 / 6]],
    "seq-mean-token-sum": [[1 / 2, 1 / 2, 0], [1 / 2, 1 / 2, 1 / 2]],
    "seq-mean-token-sum-norm": [[1 / 6, 1 / 6, 0], [1 / 6, 1 / 6, 1 / 6]],  # max_len = T = 3
}


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def make_inputs(q=Q, r=R, adv=A, mask=MASK, rewards=(1.0, 0.0), **extra) -> LossInputs:
    behav = t(BEHAV)
    prox = behav + torch.log(t(q))
    logp = (prox + torch.log(t(r))).detach().requires_grad_(True)
    rew = None if rewards is None else t(list(rewards))
    return LossInputs(logp, prox, behav, t(adv), t(mask), rewards=rew, **extra)


def reinforce_table(w):
    """Per-token -w*A*logp and its gradient -w*A, for the REINFORCE-style losses."""
    loss = [[-w[i][j] * A[i][j] * LOGP[i][j] for j in range(3)] for i in range(2)]
    grad = [[-w[i][j] * A[i][j] for j in range(3)] for i in range(2)]
    return loss, grad


PAD = 0.0  # the padding token's entry: never counts (weight 0)
S0, S1 = math.sqrt(1.05), 1.287 ** (1 / 3)  # gspo per-sample ratios: exp(mean ln R) over the mask

# name -> (knobs, per-token loss table, per-token d loss / d logp table), all by hand
CASES = {
    "vanilla": ({}, *reinforce_table([[1, 1, 1], [1, 1, 1]])),
    # naive PPO, r = R_behav: (0,0) r=1.5, A>0 -> clipped at 1.2; (0,1) r=1.4, A<0 -> unclipped
    # side 1.4 > 1.2; (1,0) r=0.45, A<0 -> clipped at 0.8: 1.6; (1,1) inside; (1,2) r=10.4, A<0
    # -> unclipped 10.4 (no dual clip).
    "ppo": ({}, [[-1.2, 1.4, PAD], [1.6, -0.55, 10.4]], [[0.0, 1.4, PAD], [0.0, -0.55, 10.4]]),
    # w = min(Q, 5) = [[1, 2, -], [0.5, 1, 5]] times the ppo table
    "decoupled_ppo": ({}, [[-1.2, 1.6, PAD], [0.9, -0.55, 6.5]], [[0.0, 0.0, PAD], [0.9, -0.55, 6.5]]),
    # w = clip(R_behav, 0, 2)
    "tis": ({}, *reinforce_table([[1.5, 1.4, PAD], [0.45, 1.1, 2.0]])),
    # w = clip(R_behav, 0, 5) with the defaults eps_low 1, eps_high 4
    "cispo": ({}, *reinforce_table([[1.5, 1.4, PAD], [0.45, 1.1, 5.0]])),
    # sample 0 positive (reward 1 > 0): w = 1; sample 1 negative: trajectory ratio
    # 0.45 * 1.1 * 10.4 = 5.148 -> min(5.148, 1) = 1
    "topr": ({}, *reinforce_table([[1, 1, PAD], [1.0, 1.0, 1.0]])),
    # ratios S0 = 1.0247, S1 = 1.0877 lie inside [0.8, 1.2]: -s*A, gradient -s*A
    "gspo": (
        {"clip_low": 0.2, "clip_high": 0.2, "old_policy": "prox"},
        [[-S0 * 1.0, S0 * 1.0, PAD], [S1 * 2.0, -S1 * 0.5, S1 * 1.0]],
        [[-S0 * 1.0, S0 * 1.0, PAD], [S1 * 2.0, -S1 * 0.5, S1 * 1.0]],
    ),
}


def expected(loss_table, grad_table, agg):
    w = AGG_WEIGHTS[agg]
    value = sum(w[i][j] * loss_table[i][j] for i in range(2) for j in range(3))
    return value, t([[w[i][j] * grad_table[i][j] for j in range(3)] for i in range(2)])


@pytest.mark.parametrize("agg", list(AGG_WEIGHTS))
@pytest.mark.parametrize("name", list(CASES))
def test_loss_matches_hand_values(name, agg):
    knobs, loss_table, grad_table = CASES[name]
    inputs = make_inputs()
    loss, metrics = policy_loss(name, inputs, agg=agg, **knobs)
    loss.backward()
    value, grad = expected(loss_table, grad_table, agg)
    assert loss.item() == pytest.approx(value, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(inputs.logp.grad, grad)
    assert metrics["loss"] == pytest.approx(value)
    assert all(isinstance(v, float) for v in metrics.values())


def test_every_builtin_loss_has_a_hand_case():
    assert set(CASES) == {row["name"] for row in algos.describe_losses()}


def test_aggregation_modes_by_hand():
    per_token = t([[1.0, 2.0, 100.0], [3.0, 4.0, 5.0]])  # 100 is padding and must not count
    mask = t(MASK)
    assert algos.aggregate(per_token, mask, "token-mean").item() == pytest.approx(15 / 5)
    assert algos.aggregate(per_token, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 4.0) / 2)
    assert algos.aggregate(per_token, mask, "seq-mean-token-sum").item() == pytest.approx(15 / 2)
    assert algos.aggregate(per_token, mask, "seq-mean-token-sum-norm").item() == pytest.approx(15 / (2 * 3))
    assert algos.aggregate(per_token, mask, "seq-mean-token-sum-norm", max_len=10).item() == pytest.approx(
        15 / (2 * 10)
    )


def test_max_len_reaches_the_loss():
    inputs = make_inputs()
    loss, _ = policy_loss("vanilla", inputs, agg="seq-mean-token-sum-norm", max_len=4)
    table, _ = CASES["vanilla"][1:]
    hand = sum(table[i][j] * MASK[i][j] for i in range(2) for j in range(3)) / (2 * 4)
    assert loss.item() == pytest.approx(hand)


def test_empty_mask_gives_zero_not_nan():
    inputs = make_inputs(mask=[[0.0] * 3] * 2)
    for agg in AGG_WEIGHTS:
        loss, metrics = policy_loss("ppo", inputs, agg=agg)
        loss.backward()
        assert loss.item() == 0.0 and not math.isnan(metrics["ratio/mean"])
        assert torch.all(inputs.logp.grad == 0)


# -- identities --------------------------------------------------------------------------------


def _random_on_policy(seed: int):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(4, 6, generator=g, dtype=F64) * 3
    adv = torch.randn(4, 6, generator=g, dtype=F64)
    mask = (torch.rand(4, 6, generator=g) > 0.3).to(F64)
    rewards = torch.tensor([1.0, -1.0, 0.0, 2.0], dtype=F64)
    return lp, adv, mask, rewards


def _grad(name, lp, prox, behav, adv, mask, rewards, agg="token-mean", **knobs):
    logp = lp.clone().requires_grad_(True)
    loss, _ = policy_loss(name, LossInputs(logp, prox, behav, adv, mask, rewards=rewards), agg=agg, **knobs)
    loss.backward()
    return loss, logp.grad


@pytest.mark.parametrize("agg", list(AGG_WEIGHTS))
@pytest.mark.parametrize(
    "name,knobs",
    [
        ("ppo", {}),
        ("ppo", {"dual_clip": 3.0}),
        ("decoupled_ppo", {}),
        ("tis", {}),
        ("tis", {"level": "sequence"}),
        ("cispo", {}),
        ("topr", {}),
        ("gspo", {}),
    ],
)
def test_on_policy_gradient_equals_vanilla(name, knobs, agg):
    lp, adv, mask, rewards = _random_on_policy(0)
    _, g_vanilla = _grad("vanilla", lp, lp, lp, adv, mask, rewards, agg)
    _, g = _grad(name, lp, lp, lp, adv, mask, rewards, agg, **knobs)
    assert g_vanilla.abs().sum() > 0
    torch.testing.assert_close(g, g_vanilla)


def test_off_policy_gradient_differs_from_vanilla():
    """The identity above is not vacuous: off policy, the corrections change the gradient."""
    lp, adv, mask, rewards = _random_on_policy(1)
    behav = lp + 0.7  # ratio exp(-0.7) = 0.5 < 1: every correction engages
    _, g_vanilla = _grad("vanilla", lp, behav, behav, adv, mask, rewards)
    for name in ("ppo", "tis", "cispo", "topr"):
        _, g = _grad(name, lp, behav, behav, adv, mask, rewards)
        assert not torch.allclose(g, g_vanilla), name


@pytest.mark.parametrize("knobs", [{}, {"clip_low": 0.1, "clip_high": 0.28}, {"dual_clip": 1.5}])
def test_decoupled_ppo_equals_ppo_when_prox_is_behav(knobs):
    lp, adv, mask, rewards = _random_on_policy(2)
    prox = lp + 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    l_ppo, g_ppo = _grad("ppo", lp, prox, prox, adv, mask, rewards, **knobs)
    l_dec, g_dec = _grad("decoupled_ppo", lp, prox, prox, adv, mask, rewards, **knobs)
    assert l_ppo.item() == pytest.approx(l_dec.item())
    torch.testing.assert_close(g_dec, g_ppo)
    # and they differ once prox != behav
    l_off, _ = _grad("decoupled_ppo", lp, prox, prox - 0.5, adv, mask, rewards, **knobs)
    assert l_off.item() != pytest.approx(l_ppo.item())


@pytest.mark.parametrize("adv,bound,side", [(1.0, 1.2, "high"), (-1.0, 0.8, "low")])
def test_clipping_engages_exactly_at_the_bounds(adv, bound, side):
    eps = 1e-6
    for offset, clipped in [(-eps, side == "low"), (+eps, side == "high")]:
        r = bound + offset
        inputs = _one_token(r, adv)
        loss, m = policy_loss("ppo", inputs)
        loss.backward()
        grad = inputs.logp.grad.item()
        if clipped:
            assert grad == 0.0 and m["clipfrac"] == 1.0 and m[f"clipfrac_{side}"] == 1.0
            assert loss.item() == pytest.approx(-adv * bound)
        else:
            assert grad == pytest.approx(-adv * r) and m["clipfrac"] == 0.0


def _one_token(ratio: float, adv: float, prox: float = -1.0) -> LossInputs:
    logp = t([[prox + math.log(ratio)]]).requires_grad_(True)
    return LossInputs(logp, t([[prox]]), t([[prox]]), t([[adv]]), t([[1.0]]))


def test_dual_clip_bounds_negative_advantage_terms():
    # r = 4, A = -1: PPO term -min(-4, -1.2) = 4, dual clip c = 3 bounds it at -c*A = 3
    inputs = _one_token(4.0, -1.0)
    loss, m = policy_loss("ppo", inputs, dual_clip=3.0)
    loss.backward()
    assert loss.item() == pytest.approx(3.0) and inputs.logp.grad.item() == 0.0
    assert m["dual_clipfrac"] == 1.0
    # below the bound the term is the plain unclipped one, gradient -A*r = 2
    inputs = _one_token(2.0, -1.0)
    loss, m = policy_loss("ppo", inputs, dual_clip=3.0)
    loss.backward()
    assert loss.item() == pytest.approx(2.0) and inputs.logp.grad.item() == pytest.approx(2.0)
    assert m["dual_clipfrac"] == 0.0
    # positive advantages are never dual-clipped: r = 4 > 1.2 -> ordinary clip at -1.2
    loss, m = policy_loss("ppo", _one_token(4.0, 1.0), dual_clip=3.0)
    assert loss.item() == pytest.approx(-1.2) and m["dual_clipfrac"] == 0.0


def test_dual_clip_in_the_hand_fixture():
    # token (1,2): r = 1.3, A = -1 -> 1.3 > -c*A = 1.25: bounded, no gradient
    inputs = make_inputs()
    loss, m = policy_loss("ppo", inputs, agg="seq-mean-token-sum", dual_clip=1.25, old_policy="prox")
    loss.backward()
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 1.8 - 0.55 + 1.25) / 2)
    assert inputs.logp.grad[1, 2].item() == 0.0
    assert m["dual_clipfrac"] == pytest.approx(1 / 5)


def test_ppo_metrics_by_hand():
    _, m = policy_loss("ppo", make_inputs(), old_policy="prox")
    assert m["clipfrac"] == pytest.approx(2 / 5)
    assert m["clipfrac_high"] == pytest.approx(1 / 5) and m["clipfrac_low"] == pytest.approx(1 / 5)
    assert m["ratio/max"] == pytest.approx(1.5) and m["ratio/min"] == pytest.approx(0.7)
    assert m["ratio/mean"] == pytest.approx((1.5 + 0.7 + 0.9 + 1.1 + 1.3) / 5)
    assert m["ratio_behav/max"] == pytest.approx(10.4)
    k3 = [x - 1 - math.log(x) for x in (1.5, 1.4, 0.45, 1.1, 10.4)]
    assert m["approx_kl/behav"] == pytest.approx(sum(k3) / 5)
    assert m["tokens"] == 5.0


def test_knob_changes_the_result():
    """A knob passed by name reaches the loss: clip_high 0.6 unclips token (0,0) (r = 1.5)."""
    inputs = make_inputs()
    loss, _ = policy_loss("ppo", inputs, agg="seq-mean-token-sum", clip_high=0.6, old_policy="prox")
    assert loss.item() == pytest.approx((-1.5 + 0.8 + 1.8 - 0.55 + 1.3) / 2)


def test_decoupled_ppo_caps_behaviour_weight():
    _, m = policy_loss("decoupled_ppo", make_inputs())
    assert m["is_capfrac"] == pytest.approx(1 / 5)  # Q = 8 > 5 at token (1,2)
    assert m["is_weight/max"] == 5.0 and m["is_weight/min"] == pytest.approx(0.5)
    inputs = make_inputs()
    loss, _ = policy_loss("decoupled_ppo", inputs, agg="seq-mean-token-sum", behav_cap=None)
    assert loss.item() == pytest.approx((-1.2 + 1.6 + 0.9 - 0.55 + 8 * 1.3) / 2)


def test_tis_sequence_level_uses_one_weight_per_sample():
    # sample 0: exp(ln 1.5 + ln 1.4) = 2.1; sample 1: exp(ln(0.45 * 1.1 * 10.4)) = 5.148 -> cap 3
    inputs = make_inputs()
    loss, m = policy_loss("tis", inputs, agg="seq-mean-token-sum", level="sequence", cap=3.0)
    loss.backward()
    w = [[2.1, 2.1, 2.1], [3.0, 3.0, 3.0]]
    table, grad = reinforce_table(w)
    hand = sum(table[i][j] * MASK[i][j] for i in range(2) for j in range(3)) / 2
    assert loss.item() == pytest.approx(hand)
    torch.testing.assert_close(inputs.logp.grad, t(grad) * t(MASK) / 2)
    assert m["is_weight/min"] == pytest.approx(2.1) and m["is_weight/max"] == pytest.approx(3.0)
    assert m["is_clipfrac"] == pytest.approx(3 / 5)  # the 3 tokens of sample 1


def test_cispo_clips_weights_but_keeps_gradients():
    inputs = make_inputs()
    loss, m = policy_loss("cispo", inputs, agg="seq-mean-token-sum", eps_low=0.2, eps_high=0.2)
    loss.backward()
    _, grad = reinforce_table([[1.2, 1.2, PAD], [0.8, 1.1, 1.2]])
    torch.testing.assert_close(inputs.logp.grad, t(grad) * t(MASK) / 2)
    assert bool((inputs.logp.grad[t(MASK) > 0] != 0).all())  # no token loses its gradient
    assert m["clipfrac_high"] == pytest.approx(3 / 5) and m["clipfrac_low"] == pytest.approx(1 / 5)


@pytest.mark.parametrize(
    "threshold,weights",
    [
        (0.0, [[2.0, 2.0, 2.0], [0.5 * 0.45, 0.5, 0.5]]),  # sample 0 (reward 1) positive
        (1.0, [[0.5, 0.5, 0.5], [0.5 * 0.45, 0.5, 0.5]]),  # 1 > 1 is false: both negative
        (-0.5, [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]),  # both positive
    ],
)
def test_topr_threshold_split(threshold, weights):
    inputs = make_inputs()
    loss, m = policy_loss(
        "topr",
        inputs,
        agg="seq-mean-token-sum",
        threshold=threshold,
        positive_weight=2.0,
        negative_weight=0.5,
        level="token",
    )
    loss.backward()
    _, grad = reinforce_table(weights)
    torch.testing.assert_close(inputs.logp.grad, t(grad) * t(MASK) / 2)
    positives = sum(r > threshold for r in (1.0, 0.0))
    assert m["positive_frac"] == pytest.approx(positives / 2)


def test_topr_needs_rewards():
    with pytest.raises(ValueError, match="rewards"):
        policy_loss("topr", make_inputs(rewards=None))


def test_gspo_per_sample_ratio_and_sequence_gradient():
    """GSPO with per-sample A and seq-mean-token-mean equals the paper's sequence objective,
    written directly with the ratio s_i carrying gradient through every token."""
    adv = [[1.0] * 3, [-2.0] * 3]
    for clip in (0.2, 0.02):  # S0 = 1.0247 is clipped at 0.02 with A > 0; S1 is never clipped
        inputs = make_inputs(adv=adv)
        loss, m = policy_loss(
            "gspo", inputs, agg="seq-mean-token-mean", clip_low=clip, clip_high=clip, old_policy="prox"
        )
        loss.backward()
        assert m["seq_ratio/max"] == pytest.approx(S1) and m["seq_ratio/min"] == pytest.approx(S0)
        logp = inputs.logp.detach().clone().requires_grad_(True)
        mask = t(MASK)
        s = torch.exp(((logp - inputs.prox_logp) * mask).sum(-1) / mask.sum(-1))
        a = t([1.0, -2.0])
        direct = -torch.minimum(s * a, s.clamp(1 - clip, 1 + clip) * a).mean()
        direct.backward()
        assert loss.item() == pytest.approx(direct.item())
        torch.testing.assert_close(inputs.logp.grad, logp.grad)
    assert m["clipfrac"] == pytest.approx(2 / 5)  # both tokens of sample 0


def test_gspo_default_clip_is_the_papers():
    inputs = make_inputs(adv=[[1.0] * 3, [-2.0] * 3])
    loss, _ = policy_loss("gspo", inputs, agg="seq-mean-token-mean", old_policy="prox")
    # sample 0: S0 > 1 + 4e-4 with A = 1 -> clipped at -(1.0004); sample 1: unclipped 2 * S1
    assert loss.item() == pytest.approx((-1.0004 + 2 * S1) / 2)


# -- add-ons -----------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_addon_by_hand(estimator):
    ref = t([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    inputs = make_inputs(ref_logp=ref)
    loss, m = policy_loss("vanilla", inputs, agg="seq-mean-token-sum", kl_coef=0.1, kl_estimator=estimator)
    loss.backward()
    x = [[-1.0 - LOGP[i][j] for j in range(3)] for i in range(2)]  # ref - logp
    k = {"k1": lambda v: -v, "k2": lambda v: 0.5 * v * v, "k3": lambda v: math.exp(v) - 1 - v}
    dk = {"k1": lambda v: 1.0, "k2": lambda v: -v, "k3": lambda v: 1 - math.exp(v)}  # d/dlogp
    table, grad = reinforce_table([[1] * 3] * 2)
    hand = sum((table[i][j] + 0.1 * k[estimator](x[i][j])) * MASK[i][j] for i in range(2) for j in range(3)) / 2
    hand_grad = [[(grad[i][j] + 0.1 * dk[estimator](x[i][j])) * MASK[i][j] / 2 for j in range(3)] for i in range(2)]
    assert loss.item() == pytest.approx(hand)
    torch.testing.assert_close(inputs.logp.grad, t(hand_grad))
    kl_tokens = [k[estimator](x[i][j]) for i in range(2) for j in range(3) if MASK[i][j]]
    assert m["kl_ref"] == pytest.approx(sum(kl_tokens) / 5)
    assert m["pg_loss"] == pytest.approx(sum(table[i][j] * MASK[i][j] for i in range(2) for j in range(3)) / 2)


def test_entropy_bonus_by_hand():
    ent = t([[0.5, 1.0, 9.0], [2.0, 0.0, 1.5]]).requires_grad_(True)
    inputs = make_inputs(entropy=ent)
    loss, m = policy_loss("ppo", inputs, entropy_coef=0.01, old_policy="prox")
    loss.backward()
    ppo_hand = (-1.2 + 0.8 + 1.8 - 0.55 + 1.3) / 5
    assert loss.item() == pytest.approx(ppo_hand - 0.01 * (0.5 + 1.0 + 2.0 + 0.0 + 1.5) / 5)
    torch.testing.assert_close(ent.grad, -0.01 * t(MASK) / 5)
    assert m["entropy"] == pytest.approx(5.0 / 5)


def test_addons_need_their_inputs():
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss("ppo", make_inputs(), kl_coef=0.1)
    with pytest.raises(ValueError, match="entropy"):
        policy_loss("ppo", make_inputs(), entropy_coef=0.1)


def test_per_sample_advantages_broadcast():
    a = make_inputs(adv=[[1.0] * 3, [-2.0] * 3])
    b = make_inputs(adv=[1.0, -2.0])
    assert policy_loss("ppo", a)[0].item() == pytest.approx(policy_loss("ppo", b)[0].item())


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="prox_logp"):
        LossInputs(t(LOGP), t([[0.0]]), t(BEHAV), t(A), t(MASK))


# -- TOPR at both levels -------------------------------------------------------------------------

# R_behav row 1 = Q * R = [0.5 * 0.9, 1.0 * 1.1, 8.0 * 0.125] = [0.45, 1.1, 1.0]: trajectory ratio
# 0.45 * 1.1 * 1.0 = 0.495 < 1, so the sequence level tapers the whole negative sample.
TOPR_R = [[1.5, 0.7, 2.0], [0.9, 1.1, 0.125]]
TOPR_LOGP1 = [-1.5 + math.log(0.45), -0.3 + math.log(1.1), -2.5]


@pytest.mark.parametrize("level,w1", [("sequence", [0.495, 0.495, 0.495]), ("token", [0.45, 1.0, 1.0])])
def test_topr_levels_by_hand(level, w1):
    """Sample 0 (reward 1 > 0) is positive: weight 1 whatever its ratio (R_behav 1.5, 1.4 > 1).
    Sample 1 (reward 0) is negative: sequence level min(0.495, 1) on every token; token level
    min(ρ_t, 1) = [0.45, 1, 1]. seq-mean-token-sum: loss Σ −w·A·logp / 2, gradient −w·A / 2."""
    inputs = make_inputs(r=TOPR_R)
    kw = {} if level == "sequence" else {"level": "token"}
    loss, m = policy_loss("topr", inputs, agg="seq-mean-token-sum", **kw)
    loss.backward()
    a1 = A[1]
    hand = (-(1.0 * LOGP[0][0]) - (-1.0 * LOGP[0][1]) - sum(w1[j] * a1[j] * TOPR_LOGP1[j] for j in range(3))) / 2
    assert loss.item() == pytest.approx(hand)
    grad = [[-A[0][0] / 2, -A[0][1] / 2, 0.0], [-w1[j] * a1[j] / 2 for j in range(3)]]
    torch.testing.assert_close(inputs.logp.grad, t(grad))
    assert m["is_weight/min"] == pytest.approx(min(w1))


def test_topr_splits_on_the_reward_not_the_advantage():
    """A positive reward with a negative advantage stays positive: weight 1, no taper."""
    inputs = make_inputs(r=TOPR_R, rewards=(0.0, 1.0))  # now sample 1 is the positive one
    loss, m = policy_loss("topr", inputs, agg="seq-mean-token-sum")
    loss.backward()
    # sample 0 negative: trajectory ratio 1.5 * 1.4 = 2.1 -> min(2.1, 1) = 1; sample 1: weight 1
    torch.testing.assert_close(inputs.logp.grad, -t(A) * t(MASK) / 2)
    assert m["positive_frac"] == 0.5
    assert m["is_clipfrac"] == 1.0  # of the negative sample's tokens: both truncated at 1
