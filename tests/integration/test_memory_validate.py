"""`flash validate` prints each GPU role's estimated memory and refuses a card too small (whole
recipes: preflight included); the trainer's memory trace at a model's full depth equals the two-
and three-layer traces extended window by window (flash.app.memory_trace.train_phases), with and
without activation checkpointing: what lets `flash validate` trace a deep model in seconds. CPU
only, no Ray; about 10 s in all."""

import pytest
from transformers import Qwen2Config

from flash.app.cli import main
from flash.app.memory_trace import TrainShape, trace_train, train_phases
from tests.helpers.standins import gpu_recipe_overrides


@pytest.mark.parametrize("checkpointing", [False, True])
def test_two_and_three_layer_traces_extended_give_the_full_depth_trace(checkpointing):
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=5,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
    )
    shape = TrainShape(2, 32, 4, "bfloat16", checkpointing)
    full = trace_train(config, shape)
    assert train_phases(config, shape) == full
    assert full.layers == 5 and full.params == 4 * (2 * 512 * 64 + 5 * 37120 + 64)  # untied head


def test_validate_prints_the_estimates_and_refuses_a_card_too_small(tmp_path, capsys):
    stand_ins = gpu_recipe_overrides(tmp_path, "gsm8k_1gpu")
    assert main(["validate", "gsm8k_1gpu", *stand_ins, "resources.card=H100"]) == 0
    out = [line for line in capsys.readouterr().out.splitlines() if line.startswith("memory: ")]
    assert [line.split(":")[1] for line in out] == [
        " actor_train on GPU 0",
        " actor_infer on GPU 0",
        " GPU 0 (H100, 79.60 GiB)",
    ]
    assert main(["validate", "gsm8k_1gpu", *stand_ins, "resources.gpu_memory_gib=0.1"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "GPU 0 needs an estimated" in err and "but the 0.1 GiB card has 0.10 GiB: lower rollout.max_num_seqs" in err
