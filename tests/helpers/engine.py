"""A small Qwen2 for the torch engine's tests, its prompts, and a request builder."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from flash.engine.base import GenerationRequest, SamplingParams

PROMPTS = [[1, 2, 3], [5], [9, 8, 7, 6, 5, 4, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]


def make_model(seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        initializer_range=0.2,
        max_position_embeddings=256,
    )
    return Qwen2ForCausalLM(cfg).eval()


def req(rid, prompt, n=8, temperature=0.0, **kw) -> GenerationRequest:
    return GenerationRequest(rid, list(prompt), SamplingParams(max_new_tokens=n, temperature=temperature, **kw))
