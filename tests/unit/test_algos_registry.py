"""Registries: closest-name errors, knob checks, describe, plugins (decorator and entry point)."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from flash import algos
from flash.algos import LossInputs, Registry, policy_loss, validate_loss


def _inputs() -> LossInputs:
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    return LossInputs(
        logp,
        logp.detach(),
        logp.detach(),
        torch.tensor([[1.0, 1.0]]),
        torch.tensor([[1.0, 1.0]]),
        rewards=torch.tensor([1.0]),
    )


@pytest.mark.parametrize(
    "name,knobs,agg,closest",
    [
        ("ppp", {}, None, "'ppo'"),
        ("decoupled-ppo", {}, None, "'decoupled_ppo'"),
        ("ppo", {"clip_hihg": 0.3}, None, "'clip_high'"),
        ("ppo", {"kl_coeff": 0.1}, None, "'kl_coef'"),
        ("ppo", {}, "token_mean", "'token-mean'"),
        ("ppo", {"agg": "seq-mean-token-summ"}, None, "'seq-mean-token-sum'"),
        ("tis", {"level": "sequense"}, None, "'sequence'"),
        ("ppo", {"kl_estimator": "k4"}, None, "'k3'"),
    ],
)
def test_errors_name_the_closest_and_list_all(name, knobs, agg, closest):
    with pytest.raises(ValueError, match=closest) as err:
        validate_loss(name, knobs, agg)
    assert "valid:" in str(err.value)
    with pytest.raises(ValueError, match=closest):
        policy_loss(name, _inputs(), **({"agg": agg} if agg else {}), **knobs)


def test_unknown_loss_lists_every_loss():
    with pytest.raises(ValueError) as err:
        validate_loss("nope", {})
    for row in algos.describe_losses():
        assert row["name"] in str(err.value)


@pytest.mark.parametrize(
    "name,knobs,match",
    [
        ("ppo", {"clip_low": "0.2"}, "float"),
        ("ppo", {"clip_low": True}, "float"),
        ("ppo", {"clip_low": 1.5}, r"\[0, 1\)"),
        ("ppo", {"dual_clip": 1.0}, "dual_clip"),
        ("tis", {"cap": 0}, "cap"),
        ("ppo", {"max_len": 512}, "seq-mean-token-sum-norm"),
        ("ppo", {"agg": "seq-mean-token-sum-norm", "max_len": 0}, "max_len"),
    ],
)
def test_bad_knob_values_are_errors(name, knobs, match):
    with pytest.raises(ValueError, match=match):
        validate_loss(name, knobs)


def test_valid_knobs_pass():
    validate_loss(
        "ppo",
        {
            "clip_low": 0.2,
            "clip_high": 0.28,
            "dual_clip": 3,
            "kl_coef": 0.01,
            "kl_estimator": "k1",
            "entropy_coef": 0.001,
        },
    )
    validate_loss("vanilla", {"agg": "seq-mean-token-sum-norm", "max_len": 1024})
    validate_loss("decoupled_ppo", {"behav_cap": None})


def test_describe_lists_knobs_with_defaults():
    rows = {r["name"]: r for r in algos.describe_losses()}
    assert rows["ppo"]["knobs"] == {
        "clip_low": 0.2,
        "clip_high": 0.2,
        "dual_clip": None,
        "old_policy": "behav",
        "kl_coef": 0.0,
        "kl_estimator": "k3",
        "entropy_coef": 0.0,
    }
    assert rows["tis"]["knobs"]["cap"] == 2.0 and rows["tis"]["knobs"]["level"] == "token"
    assert all(r["description"] for r in rows.values())
    adv = {r["name"]: r for r in algos.describe_advantages()}
    assert adv["gae"]["knobs"] == {"gamma": 1.0, "lam": 1.0, "clip": None, "whiten": False, "whiten_unbiased": False}
    assert "reinforce++" in adv["reinforce_pp"]["aliases"]
    aggs = {r["name"]: r["knobs"] for r in algos.describe_aggregations()}
    assert aggs["seq-mean-token-sum-norm"] == {"max_len": None} and aggs["token-mean"] == {}


PLUGIN = textwrap.dedent('''
    from flash import algos

    @algos.register_loss("scaled_vanilla_{tag}", description="-scale*A*logp")
    def scaled_vanilla(inputs, *, scale: float = 2.0):
        return -scale * inputs.advantages * inputs.logp, {{"scale": scale}}

    @algos.register_advantage("constant_{tag}")
    def constant(inputs, *, value: float = 1.0):
        """Every token gets ``value``."""
        return value * inputs.mask
''')


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    tag = tmp_path.name.replace("-", "_")
    module = f"flash_test_plugin_{tag}"
    (tmp_path / f"{module}.py").write_text(PLUGIN.format(tag=tag))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield module, tag
    sys.modules.pop(module, None)
    for reg, name in ((algos.LOSSES, f"scaled_vanilla_{tag}"), (algos.ADVANTAGES, f"constant_{tag}")):
        if name in reg.names():
            reg.unregister(name)


def test_plugin_by_decorator_is_usable_by_name(plugin_module):
    module, tag = plugin_module
    name = f"scaled_vanilla_{tag}"
    with pytest.raises(ValueError):
        validate_loss(name, {})
    assert algos.load_plugins([module]) == [module]
    validate_loss(name, {"scale": 3.0, "kl_coef": 0.0})
    loss, metrics = policy_loss(name, _inputs(), agg="seq-mean-token-sum", scale=3.0)
    assert loss.item() == pytest.approx(-3.0 * (-1.0 - 2.0))
    assert metrics["scale"] == 3.0
    row = next(r for r in algos.describe_losses() if r["name"] == name)
    assert row["knobs"]["scale"] == 2.0 and row["description"] == "-scale*A*logp"
    with pytest.raises(ValueError, match="'scale'"):
        validate_loss(name, {"scal": 1.0})
    adv = algos.compute_advantages(f"constant_{tag}", [0.0], [0], torch.ones(1, 3), value=0.5)
    assert adv.tolist() == [[0.5, 0.5, 0.5]]
    desc = next(r for r in algos.describe_advantages() if r["name"] == f"constant_{tag}")
    assert desc["description"] == "Every token gets ``value``."
    algos.load_plugins([module])  # importing again is harmless


def test_missing_plugin_module_is_an_error():
    with pytest.raises(ImportError, match="no_such_flash_plugin"):
        algos.load_plugins(["no_such_flash_plugin"])


def test_entry_point_loaded_lazily(tmp_path, monkeypatch):
    group = f"flash.test_losses_{tmp_path.name.replace('-', '_')}"
    (tmp_path / "ep_plugin_mod.py").write_text(
        textwrap.dedent('''
        def my_loss(inputs, *, k: float = 1.5):
            """A loss from an entry point."""
            return -k * inputs.advantages * inputs.logp, {}
    ''')
    )
    dist = tmp_path / "flash_ep_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: flash-ep-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{group}]\nmy_ep_loss = ep_plugin_mod:my_loss\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry("loss", group)
    assert "ep_plugin_mod" not in sys.modules  # nothing imported before the first lookup
    entry = reg.get("my_ep_loss")
    assert entry.knobs == {"k": 1.5} and entry.description == "A loss from an entry point."
    sys.modules.pop("ep_plugin_mod", None)


def test_broken_entry_point_is_named(tmp_path, monkeypatch):
    group = f"flash.test_broken_{tmp_path.name.replace('-', '_')}"
    dist = tmp_path / "flash_broken-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: flash-broken\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{group}]\nbad = no_such_module_xyz:fn\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match="'bad'"):
        Registry("loss", group).get("anything")


def test_registration_rules():
    reg = Registry("loss", "flash.test_none", reserved={"kl_coef"})

    @reg.register("a")
    def a(inputs, *, x: int = 1):
        return inputs

    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(lambda inputs: inputs)
    with pytest.raises(ValueError, match="reserved"):

        @reg.register("b")
        def b(inputs, *, kl_coef: float = 0.0):
            return inputs

    with pytest.raises(TypeError, match="default"):

        @reg.register("c")
        def c(inputs, *, y):
            return inputs

    _, full = reg.resolve("a", {"x": 3})
    assert full == {"x": 3}
    with pytest.raises(ValueError, match="int"):
        reg.resolve("a", {"x": 2.5})
