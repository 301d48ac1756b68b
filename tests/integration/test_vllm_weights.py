"""flash.engine.vllm_weights: what a weight push into vLLM must pass before anything is loaded
(pure functions of the checkpoint's shapes; no vLLM needed)."""

import pytest
import torch
from safetensors.torch import load

from flash.engine.vllm_weights import check_whole_layers, layer_buckets, weights_blob, wire_sent
from flash.weights.cuda_ipc import handle_from_wire
from flash.weights.model_update import ModelUpdateError

SHAPES = {
    "model.layers.0.self_attn.q_proj.weight": (4, 4),
    "model.layers.0.self_attn.k_proj.weight": (2, 4),
    "model.layers.0.self_attn.v_proj.weight": (2, 4),
    "model.layers.0.mlp.down_proj.weight": (4, 8),
    "model.embed_tokens.weight": (10, 4),
}
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


LAYERS = {
    **{f"model.layers.{i}.self_attn.{p}_proj.weight": (4, 4) for i in range(2) for p in "qkv"},
    **{f"model.layers.{i}.mlp.down_proj.weight": (4, 8) for i in range(2)},
    "model.embed_tokens.weight": (10, 4),
}


def test_layer_buckets_hold_whole_layers_in_the_engine_dtype_under_the_bound():
    # bf16 sizes: a qkv layer 3 × 32 B = 96 B, a down_proj 64 B, the embedding 80 B; bound 160 B
    trainer = {n: torch.randn(s) for n, s in LAYERS.items()}
    order = sorted(trainer, key=lambda n: ("k_proj" in n, n))  # every k_proj last: layers complete late
    buckets = list(layer_buckets(((n, trainer[n]) for n in order), LAYERS, bucket_bytes=160, dtype=torch.bfloat16))
    sizes = [sum(t.numel() * t.element_size() for t in b.values()) for b in buckets]
    assert sizes == [144, 160, 96]  # embed + down 0; down 1 + qkv 0 (complete at its k_proj); qkv 1
    for b in buckets:
        check_whole_layers(b, LAYERS)
        assert all(t.dtype == torch.bfloat16 and torch.equal(t, trainer[n].to(torch.bfloat16)) for n, t in b.items())
    assert sorted(n for b in buckets for n in b) == sorted(LAYERS)
    # a layer larger than the bound is a bucket of its own; an incomplete one is refused
    assert [len(b) for b in layer_buckets(trainer.items(), LAYERS, bucket_bytes=1)] == [3, 3, 1, 1, 1]
    with pytest.raises(ValueError, match="whole layers: model.layers.1.self_attn.qkv lacks .*v_proj"):
        list(
            layer_buckets([(n, t) for n, t in trainer.items() if n != "model.layers.1.self_attn.v_proj.weight"], LAYERS)
        )


def test_a_cuda_ipc_handle_crosses_msgpack_as_names_and_comes_back_whole():
    import msgpack

    args = (
        torch.Tensor,
        torch.Size([64]),
        (1,),
        0,
        torch.UntypedStorage,
        torch.uint8,
        0,
        b"\x01handle",
        64,
        0,
        False,
        b"ref",
        0,
        b"event",
        True,
    )
    sent = {"bytes": 64, "path": None, "send_s": 0.1, "handle": {"key": "k", "args": args, "bytes": 64}}
    wire = msgpack.unpackb(msgpack.packb(wire_sent(sent)))
    back = handle_from_wire(wire["handle"])
    assert back["args"] == (
        torch.Tensor,
        (64,),
        (1,),
        0,
        torch.UntypedStorage,
        torch.uint8,
        0,
        b"\x01handle",
        64,
        0,
        False,
        b"ref",
        0,
        b"event",
        True,
    )
    assert wire_sent({**sent, "handle": None})["handle"] is None
    wire["handle"]["args"][0] = ["class", "os.system"]
    with pytest.raises(ModelUpdateError, match="unknown class 'os.system'"):
        handle_from_wire(wire["handle"])
