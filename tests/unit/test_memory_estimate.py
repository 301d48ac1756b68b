"""The memory estimate `flash validate` prints per GPU role (flash.app.memory_fit, traced with fake
tensors by flash.app.memory_trace): it grows as the shapes say, colocated roles are summed by their
turns, a placement over the card is refused in one line, cards resolve by name."""

import pytest
from transformers import Qwen2Config

from flash.app import memory_fit as mf
from flash.app.cards import Card, resolve_card
from flash.app.config import load_config
from flash.app.memory_trace import Phases, PrefillShape, TrainShape, prefill_bytes, trace_prefill, trace_train
from flash.app.recipe_files import recipe_paths
from flash.errors import ConfigError, FlashError
from tests.helpers.standins import gpu_recipe_overrides

GIB = 2**30


def small(layers: int = 1, hidden: int = 64) -> Qwen2Config:
    """A one-layer Qwen2 (a fake op costs the same at any size; each layer adds hundreds of them)."""
    return Qwen2Config(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )


def numel(config) -> int:
    h, i, v, n = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
    kv = h // config.num_attention_heads * config.num_key_value_heads
    layer = h * h + h + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h  # q (+bias), k, v (+bias), o, mlp, 2 norms
    return v * h + n * layer + h  # tied embedding, layers, final norm


def test_trainer_resident_bytes_are_float32_weights_and_two_adamw_moments():
    for config in (small(), small(hidden=128)):
        p = trace_train(config, TrainShape(2, 32, 0))
        n, tensors = numel(config), 2 + 12 * config.num_hidden_layers  # embedding, final norm; 12 per layer
        assert p.params == 4 * n
        assert p.resident == 12 * n + 4 * tensors  # and AdamW's float32 step count per tensor
        assert p.step >= 20 * n  # weights, gradients, two moments and foreach's one temporary


def test_trainer_activation_bytes_double_with_rows_and_with_length():
    base, rows, length = (trace_train(small(), TrainShape(r, n, 0)) for r, n in ((2, 64), (4, 64), (2, 128)))
    act = {name: p.backward - p.resident for name, p in (("base", base), ("rows", rows), ("length", length))}
    assert act["rows"] / act["base"] == pytest.approx(2.0, rel=0.01)
    assert act["length"] / act["base"] == pytest.approx(2.0, rel=0.01)
    assert rows.resident == base.resident == length.resident


def test_activation_checkpointing_and_bf16_lower_the_backward_peak():
    plain, ckpt = (trace_train(small(), TrainShape(4, 128, 0, "float32", c)) for c in (False, True))
    bf16 = trace_train(small(), TrainShape(4, 128, 0, "bfloat16", True))
    assert (plain.backward, ckpt.backward, bf16.backward) == (9772884, 7668564, 6619988)


def test_extending_two_and_three_layer_prefill_traces_gives_the_full_depth_trace():
    shape = PrefillShape(16, 32, 128, "bfloat16")
    assert prefill_bytes(small(layers=5), shape) == trace_prefill(small(layers=5), shape) == 1614848


def test_torch_engine_prefill_peak_follows_its_token_budget():
    peaks = [trace_prefill(small(), PrefillShape(16, 32, budget, "bfloat16")) for budget in (0, 128)]
    assert peaks == [1012736, 515072]  # one forward of 16 × 32 tokens, or four of 4 × 32
    weights = 2 * numel(small())
    kv = 2 * 16 * 1 * (32 + 64) * 32 * 2  # (K, V) × rows × kv heads × (prompt + slack) × head dim × bf16
    assert peaks[1] > weights + kv


def test_fsdp_rank_holds_a_quarter_of_the_states_plus_its_unsharded_units():
    p = Phases(
        resident=12 * GIB,
        step=20 * GIB,
        params=4 * GIB,
        layer=GIB // 8,
        layers=24,
        first=19 * GIB,
        inner_top=20 * GIB,
        inner_bottom=19 * GIB,
        last=18 * GIB,
        first_grads=0,
        inner_top_grads=GIB,
        inner_bottom_grads=3 * GIB,
        last_grads=4 * GIB,
    )
    assert mf.rank_bytes(p, 1, 2) == (20 * GIB, 20 * GIB, 16 * GIB)
    root = 4 * GIB - 24 * (GIB // 8)  # 1 GiB of float32 weights outside the decoder layers
    unsharded = (root + 2 * (GIB // 8)) * 2 // 4 + root  # bf16 root + two layers, the root's fp32 gradient
    assert mf.rank_bytes(p, 4, 2) == (20 * GIB - 13 * GIB * 3 // 4 + unsharded, 5 * GIB, 4 * GIB)


def test_colocated_roles_are_summed_by_their_turns():
    train = mf.RoleMemory("actor_train", (0,), peak=12 * GIB, kept=7 * GIB, detail="")
    engine = mf.RoleMemory("actor_infer", (0,), peak=25 * GIB, kept=0, detail="")
    assert mf.card_peak([train, engine]) == (32 * GIB, engine)  # the engine decodes beside the trainer's states
    small_engine = mf.RoleMemory("actor_infer", (0,), peak=3 * GIB, kept=GIB, detail="")
    assert mf.card_peak([train, small_engine]) == (13 * GIB, train)
    assert mf.card_peak([engine]) == (25 * GIB, engine)


def test_placement_over_the_card_is_refused_in_one_line_naming_the_fix(tmp_path):
    cfg = load_config(recipe_paths()["gsm8k_1gpu"], gpu_recipe_overrides(tmp_path, "gsm8k_1gpu"))
    train = mf.RoleMemory("actor_train", (0,), peak=12 * GIB, kept=7 * GIB, detail="")
    engine = mf.RoleMemory("actor_infer", (0,), peak=25 * GIB, kept=0, detail="")
    card = Card("H100", int(79.6 * GIB))
    assert mf.check_cards(cfg, [train, engine], card) == [
        "GPU 0 (H100, 79.60 GiB): peak 32.00 GiB (actor_infer 25.00 GiB + actor_train 7.00 GiB kept)"
    ]
    with pytest.raises(FlashError) as err:
        mf.check_cards(cfg, [train, engine], Card("24 GiB card", 24 * GIB))
    assert str(err.value) == (
        "GPU 0 needs an estimated 32.00 GiB (actor_infer 25.00 GiB + actor_train 7.00 GiB kept) but the 24 GiB card "
        "has 24.00 GiB: lower rollout.max_num_seqs (now 512) or rollout.max_new_tokens (now 512), or give "
        "actor_infer its own GPUs"
    )


def test_known_card_names_resolve_and_a_memory_size_wins():
    assert resolve_card("H100", 0) == Card("H100", int(79.6 * GIB))
    assert resolve_card("h200", 0) == Card("H200", int(139.8 * GIB))
    assert resolve_card("", 24) == Card("24 GiB card", 24 * GIB)
    assert resolve_card("L4", 22.5) == Card("L4", int(22.5 * GIB))
    assert resolve_card("", 0) is None


def test_an_unknown_card_name_is_refused_at_load_naming_the_known_ones():
    with pytest.raises(ConfigError) as err:
        load_config(recipe_paths()["stutter"], ["resources.card=A100"])
    assert str(err.value) == (
        "resources.card=A100 is not a card flash knows (H100, H200): set "
        "resources.gpu_memory_gib to its memory in GiB instead"
    )
