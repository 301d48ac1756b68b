"""Behaviour-proximal corrections against hand-computed weights and masks, their composition with
a loss, the no-op rule (a ratio identically 1 is refused) and the per-loss policy table.

Fixture: 2 samples x 3 tokens, mask [[1, 1, 0], [1, 1, 1]], behav 0 and prox = ln ρ with

    ρ = π_prox/π_behav = [[2.0, 0.8, 9.0 (padding)], [4.0, 1.0, 0.125]]

so per sample Π ρ = [1.6, 0.5] and the geometric means are [sqrt(1.6), 0.5^(1/3)] =
[1.264911, 0.793701]; (ln ρ)² = [[0.480453, 0.049793, -], [1.921812, 0, 4.324077]].
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from flash import algos
from flash.algos import LossInputs, Ratio, policy_loss, ratio_problem
from flash.app.cli import main
from flash.app.config import load_config
from flash.errors import ConfigError

F64 = torch.float64
RHO = [[2.0, 0.8, 9.0], [4.0, 1.0, 0.125]]
MASK = [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
LOGP = [[-1.0, -2.0, -3.0], [-1.0, -0.5, -2.0]]
ADV = [[1.0, -1.0, 1.0], [1.0, 2.0, 1.0]]
STUTTER = "recipes/stutter.yaml"  # async_ratio 2, recompute_prox auto
DPPO = ["algo.loss.name=decoupled_ppo"]  # the cases below are written for decoupled PPO's three policies


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def make_inputs() -> LossInputs:
    behav = torch.zeros(2, 3, dtype=F64)
    logp = t(LOGP).requires_grad_(True)
    return LossInputs(logp, torch.log(t(RHO)), behav, t(ADV), t(MASK), rewards=t([1.0, 0.0]))


def run(name: str, **knobs):
    entry, full = algos.CORRECTIONS.resolve(name, knobs)
    w, keep, metrics = entry.fn(make_inputs(), **{k: full[k] for k in entry.knobs})
    kept = [[bool(keep[i, j]) for j in range(3) if MASK[i][j]] for i in range(2)]
    weights = [[float(w[i, j]) for j in range(3) if MASK[i][j]] for i in range(2)]
    return weights, kept, {k: float(v) for k, v in metrics.items()}


T, F = True, False
G0, G1 = math.sqrt(1.6), 0.5 ** (1 / 3)
# name, knobs -> weights on the masked tokens, kept, metrics
CASES = [
    ("token_is", {}, [[2.0, 0.8], [2.0, 1.0, 0.125]], [[T, T], [T, T, T]], {"truncated_frac": 1 / 5}),
    ("token_is", {"mode": "mask"}, [[2.0, 0.8], [4.0, 1.0, 0.125]], [[T, T], [F, T, F]], {"masked_frac": 2 / 5}),
    ("seq_is", {"cap": 1.0}, [[1.0, 1.0], [0.5, 0.5, 0.5]], [[T, T], [T, T, T]], {"truncated_frac": 2 / 5}),
    (
        "seq_is",
        {"mode": "mask", "low": 0.6},
        [[1.6, 1.6], [0.5, 0.5, 0.5]],
        [[T, T], [F, F, F]],
        {"masked_frac": 3 / 5},
    ),
    ("geo_is", {"cap": 1.0}, [[1.0, 1.0], [G1, G1, G1]], [[T, T], [T, T, T]], {"truncated_frac": 2 / 5}),
    ("geo_is", {"mode": "mask", "low": 0.8}, [[G0, G0], [G1, G1, G1]], [[T, T], [F, F, F]], {"masked_frac": 3 / 5}),
    ("icepop", {}, [[2.0, 0.8], [4.0, 1.0, 0.125]], [[T, T], [F, T, F]], {"masked_frac": 2 / 5}),
    # kept mean of (ln ρ)² after rejecting the k largest: k=2 -> (0.480453 + 0.049793 + 0) / 3
    # = 0.176749 <= 0.2; at tau 0.04 k=3 -> 0.049793 / 2 = 0.024896
    ("m2po", {"tau": 0.2}, [[1.0, 1.0], [1.0, 1.0, 1.0]], [[T, T], [F, T, F]], {"masked_frac": 2 / 5, "m2": 0.176749}),
    ("m2po", {}, [[1.0, 1.0], [1.0, 1.0, 1.0]], [[F, T], [F, T, F]], {"masked_frac": 3 / 5, "m2": 0.024896}),
]


@pytest.mark.parametrize("name,knobs,weights,kept,metrics", CASES)
def test_correction_by_hand(name, knobs, weights, kept, metrics):
    got_w, got_kept, got_m = run(name, **knobs)
    assert got_kept == kept
    for row, want in zip(got_w, weights):
        assert row == pytest.approx(want, rel=1e-6)
    for key, value in metrics.items():
        assert got_m[key] == pytest.approx(value, abs=1e-6), key


def test_every_correction_has_a_hand_case():
    assert {c[0] for c in CASES} == set(algos.CORRECTIONS.names())


def test_step_metrics_by_hand():
    """k1 = mean(−ln ρ) = −ln(0.8)/5; k3 = mean(ρ − 1 − ln ρ) = (2.925 − ln 0.8)/5; ESS of the
    truncated weights [2, 0.8, 2, 1, 0.125]: 5.925² / (5 · 9.655625)."""
    _, m = policy_loss("vanilla", make_inputs(), corrections=[{"name": "token_is"}])
    assert m["corrections/kl_k1"] == pytest.approx(-math.log(0.8) / 5)
    assert m["corrections/kl_k3"] == pytest.approx((2.925 - math.log(0.8)) / 5)
    assert m["corrections/ratio_mean"] == pytest.approx(7.925 / 5)
    assert m["corrections/ratio_max"] == pytest.approx(4.0)  # the padding's 9 does not count
    assert m["corrections/ess"] == pytest.approx(5.925**2 / (5 * 9.655625))
    assert m["corrections/token_is/truncated_frac"] == pytest.approx(1 / 5)


def test_corrections_weight_terms_and_and_the_mask():
    """icepop keeps (0,0), (0,1), (1,1) with weights 2, 0.8, 1; vanilla's terms −A·logp there are
    −2·1·(−1)... : loss = −(2·1·(−1) + 0.8·(−1)·(−2) + 1·2·(−0.5)) / 3 = 1.4 / 3 (token-mean over
    the 3 kept tokens); gradient −w·A/3 on the kept tokens, 0 elsewhere."""
    inputs = make_inputs()
    loss, m = policy_loss("vanilla", inputs, corrections=[{"name": "icepop"}])
    loss.backward()
    assert loss.item() == pytest.approx(1.4 / 3)
    torch.testing.assert_close(inputs.logp.grad, t([[-2 / 3, 0.8 / 3, 0], [0, -2 / 3, 0]]))
    assert m["tokens"] == 3.0 and m["corrections/icepop/masked_frac"] == pytest.approx(2 / 5)


def test_corrections_compose_in_order():
    """token_is (cap 2) then icepop: weights multiply (2·2, 0.8·0.8, 1·1), masks AND."""
    inputs = make_inputs()
    loss, m = policy_loss(
        "vanilla", inputs, agg="seq-mean-token-sum", corrections=[{"name": "token_is"}, {"name": "icepop"}]
    )
    loss.backward()
    torch.testing.assert_close(inputs.logp.grad, t([[-4 / 2, 0.64 / 2, 0], [0, -2 / 2, 0]]))
    assert m["corrections/token_is/truncated_frac"] == pytest.approx(1 / 5)
    assert m["corrections/icepop/masked_frac"] == pytest.approx(2 / 5)


@pytest.mark.parametrize(
    "specs,message",
    [
        ([{"name": "tokn_is"}], "did you mean 'token_is'"),
        ([{"name": "token_is", "cpa": 2.0}], "did you mean 'cap'"),
        ([{"name": "token_is", "low": 0.1}], "unused with mode 'truncate'"),
        ([{"name": "token_is", "mode": "mask", "cap": 3.0}], "unused with mode 'mask'"),
        ([{"name": "icepop"}, {"name": "icepop"}], "listed twice"),
        ([{"name": "m2po", "tau": 0.0}], "tau must be > 0"),
        ([{"name": "seq_is", "low": 3.0, "mode": "mask"}], "low <= high"),
    ],
)
def test_bad_corrections_are_refused(specs, message):
    with pytest.raises(ValueError, match=message):
        algos.validate_corrections(specs)


# -- the no-op rule ------------------------------------------------------------------------------

PB, CP, CB = Ratio("prox", "behav"), Ratio("current", "prox"), Ratio("current", "behav")
TRUST = Ratio("current", "prox", "trust")
# ratio, prox_source, async_ratio, steps per batch, explicit -> refused?
RULE = [
    (CB, "fused", 2.0, 1, False, False),  # naive ppo: behav is never the current policy
    (CB, "behav", 0.0, 1, False, False),
    (CP, "fused", 2.0, 1, False, True),  # ppo old_policy prox, prox fused: REINFORCE
    (CP, "separate", 2.0, 1, False, True),  # a second forward of the same weights
    (CP, "separate", 2.0, 4, False, False),  # several optimizer steps: prox lags current
    (CP, "behav", 2.0, 1, False, False),  # prox = behav: the ratio is current/behav
    (TRUST, "fused", 2.0, 1, False, False),  # decoupled_ppo's clip: a trust region, not a correction
    (PB, "fused", 2.0, 1, False, False),  # decoupled_ppo's weight with prox fused: live
    (PB, "behav", 2.0, 1, False, True),  # recompute_prox never at r > 0
    (PB, "behav", 0.0, 1, False, False),  # on-policy form: decoupled_ppo is ppo at r = 0
    (PB, "behav", 0.0, 1, True, True),  # a listed correction gets no exception
    (PB, "separate", 0.0, 1, True, False),
]


@pytest.mark.parametrize("ratio,source,r,steps,explicit,refused", RULE)
def test_no_op_rule_table(ratio, source, r, steps, explicit, refused):
    problem = ratio_problem(
        "x", ratio, prox_source=source, mode="auto", async_ratio=r, steps_per_batch=steps, explicit=explicit
    )
    assert (problem is not None) == refused
    if refused:
        assert "identically 1" in problem and "\n" not in problem


@pytest.mark.parametrize(
    "overrides,message",
    [
        ([], None),
        (["async_ratio=0"], None),
        (["algo.loss.name=ppo"], None),
        (["algo.loss.name=gspo"], None),
        (["algo.loss.name=ppo", "algo.loss.old_policy=prox"], "old_policy: behav"),
        (["algo.loss.name=gspo", "algo.loss.old_policy=prox", "algo.recompute_prox=always"], "several optimizer steps"),
        (["async_ratio=0", "algo.loss.name=ppo", "algo.loss.old_policy=prox"], None),
        (["algo.recompute_prox=never"], "decoupled_ppo'.*recompute_prox: always"),
        (["algo.recompute_prox=always"], None),
        (["algo.loss.name=tis", "algo.recompute_prox=never"], None),
        (["algo.corrections=[{name: token_is, cap: 3.0}]"], None),
        (["algo.loss.name=tis", "algo.corrections=[{name: m2po}]", "algo.recompute_prox=never"], "corrections 'm2po'"),
        (["async_ratio=0", "algo.corrections=[{name: icepop}]"], "recompute_prox: always"),
        (["async_ratio=0", "algo.corrections=[{name: icepop}]", "algo.recompute_prox=always"], None),
        (["algo.corrections=[{name: tokn_is}]"], "did you mean 'token_is'"),
    ],
)
def test_config_refuses_no_op_settings(overrides, message):
    if message is None:
        load_config(STUTTER, [*DPPO, *overrides])
        return
    with pytest.raises(ConfigError, match=message) as err:
        load_config(STUTTER, [*DPPO, *overrides])
    assert "\n" not in str(err.value)


def test_config_corrections_reach_the_loss_knobs():
    from flash.app.settings import loss_section

    cfg = load_config(STUTTER, [*DPPO, "algo.corrections=[{name: token_is, cap: 3.0}]"])
    assert loss_section(cfg) == {"name": "decoupled_ppo", "corrections": [{"name": "token_is", "cap": 3.0}]}
    assert loss_section(load_config(STUTTER, [])) == {"name": "topr"}


# -- the policy table ------------------------------------------------------------------------------

READS = {
    "vanilla": ["current"],
    "ppo": ["behav", "current"],
    "gspo": ["behav", "current"],
    "tis": ["behav", "current"],
    "cispo": ["behav", "current"],
    "topr": ["behav", "current"],
    "decoupled_ppo": ["behav", "prox", "current"],
}


def test_every_loss_declares_what_it_reads():
    rows = {r["name"]: r for r in algos.describe_losses()}
    assert {n: r["reads"] for n, r in rows.items()} == READS
    assert rows["ppo"]["ratios"] == ["current/behav"]
    assert rows["decoupled_ppo"]["ratios"] == ["prox/behav", "current/prox (trust region)"]
    assert algos.loss_ratios("ppo", {"old_policy": "prox"}) == (CP,)
    assert all(r["reads"] == ["behav", "prox"] for r in algos.describe_corrections())


def test_flash_losses_prints_the_table(capsys):
    assert main(["losses"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    ppo = next(i for i, line in enumerate(lines) if line.startswith("  ppo "))
    assert lines[ppo + 1].split() == ["reads:", "behav,", "current", "(ratios:", "current/behav)"]
    assert "reads: behav, prox, current (ratios: prox/behav, current/prox (trust region))" in out
    assert "reads: current (no ratio)" in out
    for name in algos.CORRECTIONS.names():
        assert f"  {name} " in out


def test_ppo_with_prox_fused_is_not_reinforce():
    """prox = sg(logp) (fused): naive ppo still clips against behav, so it is not vanilla."""
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 6, generator=g, dtype=F64) * 3
    behav = lp + 0.7  # r = exp(−0.7) = 0.50 < 0.8: clipped where A < 0
    adv = torch.randn(4, 6, generator=g, dtype=F64)
    mask = torch.ones(4, 6, dtype=F64)
    grads = {}
    for name in ("ppo", "vanilla"):
        logp = lp.clone().requires_grad_(True)
        loss, m = policy_loss(name, LossInputs(logp, logp.detach(), behav, adv, mask))
        loss.backward()
        grads[name] = logp.grad
    assert m["ratio/mean"] == pytest.approx(1.0)  # the fused ratio really is 1
    _, m = policy_loss("ppo", LossInputs(lp, lp, behav, adv, mask))
    assert m["clipfrac"] == pytest.approx(float((adv < 0).double().mean()))
    assert m["clipfrac"] > 0
    assert not torch.allclose(grads["ppo"], grads["vanilla"])


PLUGIN = '''
import torch
from flash.algos import register_correction


def _check(k):
    if not 0 < k["scale"] <= 1:
        raise ValueError(f"scale must be in (0, 1], got {k['scale']}")


@register_correction("plugin_scale", "scales every token by a constant", check=_check)
def plugin_scale(inputs, *, scale: float = 0.5):
    """A user's correction: every token kept, weighted by ``scale``."""
    w = torch.full_like(inputs.mask, scale)
    return w, torch.ones_like(inputs.mask, dtype=torch.bool), {"scale": torch.tensor(scale)}
'''


def test_a_plugin_correction_is_named_in_a_recipe_and_weights_the_loss(tmp_path, monkeypatch):
    (tmp_path / "my_corrections.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    # the registry and the module cache as they were, once the test is over
    monkeypatch.setattr(algos.CORRECTIONS, "_entries", dict(algos.CORRECTIONS._entries))
    monkeypatch.setitem(sys.modules, "my_corrections", None)
    del sys.modules["my_corrections"]
    cfg = load_config(
        STUTTER, [*DPPO, "plugins=[my_corrections]", "algo.corrections=[{name: plugin_scale, scale: 0.25}]"]
    )
    assert cfg.algo.corrections == [{"name": "plugin_scale", "scale": 0.25}]
    with pytest.raises(ConfigError, match="scale must be in"):
        load_config(STUTTER, [*DPPO, "plugins=[my_corrections]", "algo.corrections=[{name: plugin_scale, scale: 2.0}]"])
    plain, _ = policy_loss("vanilla", make_inputs())
    scaled, m = policy_loss("vanilla", make_inputs(), corrections=cfg.algo.corrections)
    assert scaled.item() == pytest.approx(0.25 * plain.item())
    assert m["corrections/plugin_scale/scale"] == pytest.approx(0.25)
    assert "plugin_scale" in {row["name"] for row in algos.describe_corrections()}
