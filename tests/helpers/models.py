"""Tiny models and tokenizers built offline, and reference greedy generation with Hugging Face."""

from __future__ import annotations

import torch

from flash.models import TinyModelConfig, build_tiny_model, build_tokenizer

PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 20, 21, 22, 23, 24, 25, 26, 27, 28], [1, 40, 41, 12, 13, 14]]


def make_model(seed: int):
    """The tiny Qwen2 policy (tied embeddings, GQA) with weights at std 0.2."""
    tokenizer = build_tokenizer()
    cfg = TinyModelConfig(
        hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, max_positions=256, seed=seed
    )
    model = build_tiny_model(tokenizer, cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return tokenizer, model


def hf_greedy(model, prompt, n) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


TINY = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=128, seed=3)


def save_tiny(path, cfg: TinyModelConfig) -> str:
    tok = build_tokenizer()
    build_tiny_model(tok, cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
