"""The trainer's memory trace at a model's full depth equals the two- and three-layer traces
extended linearly (flash.app.memory_trace.train_phases), with and without activation
checkpointing: what lets `flash validate` trace a deep model in seconds. CPU only, about 5 s."""

import pytest
from transformers import Qwen2Config

from flash.app.memory_trace import TrainShape, trace_train, train_phases


@pytest.mark.parametrize("checkpointing", [False, True])
def test_two_and_three_layer_traces_extended_give_the_full_depth_trace(checkpointing):
    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    shape = TrainShape(2, 32, 4, "bfloat16", checkpointing)
    full = trace_train(config, shape)
    assert train_phases(config, shape) == full
    assert full.layers == 5 and full.params == 4 * (2 * 512 * 64 + 5 * 37120 + 64)  # untied head
