"""flash.engine.vllm_weights: what a weight push into vLLM must pass before anything is loaded
(pure functions of the checkpoint's shapes; no vLLM needed)."""

import pytest
import torch
from safetensors.torch import load

from flash.engine.vllm_weights import check_whole_layers, weights_blob

SHAPES = {"model.layers.0.self_attn.q_proj.weight": (4, 4), "model.layers.0.self_attn.k_proj.weight": (2, 4),
          "model.layers.0.self_attn.v_proj.weight": (2, 4), "model.layers.0.mlp.down_proj.weight": (4, 8),
          "model.embed_tokens.weight": (10, 4)}
QKV = [n for n in SHAPES if "self_attn" in n]


def tensors(names):
    return {n: torch.full(SHAPES[n], float(i)) for i, n in enumerate(names)}


def test_a_whole_layer_packs_and_round_trips_and_tied_names_are_skipped():
    push = {**tensors(QKV), "lm_head.weight": torch.zeros(10, 4)}
    blob = weights_blob(push, SHAPES, tied={"lm_head.weight"})
    back = load(blob)
    assert sorted(back) == sorted(QKV)
    assert all(torch.equal(back[n], push[n]) for n in QKV)


def test_unknown_names_wrong_shapes_and_half_layers_are_refused_with_the_reason():
    with pytest.raises(KeyError, match="did you mean 'model.layers.0.mlp.down_proj.weight'"):
        weights_blob({"model.layers.0.mlp.down_prj.weight": torch.zeros(4, 8)}, SHAPES)
    with pytest.raises(ValueError, match=r"shape \(8, 4\) != model's \(4, 8\)"):
        weights_blob({"model.layers.0.mlp.down_proj.weight": torch.zeros(8, 4)}, SHAPES)
    # q, k and v are one fused layer in vLLM: q alone would be re-processed from half-loaded memory
    with pytest.raises(ValueError, match="whole layers: model.layers.0.self_attn.qkv lacks .*k_proj.*v_proj"):
        check_whole_layers(tensors(QKV[:1]), SHAPES)
    check_whole_layers(tensors(["model.layers.0.mlp.down_proj.weight"]), SHAPES)  # a layer of its own
