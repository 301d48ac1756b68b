"""The attention form a training forward takes: causal only, no padding mask.

A training batch is right-padded (``flash.train.batch``): each row's real tokens come before its
padding, so the causal mask alone keeps every real token from attending to padding, and the
outputs at real positions are the padded 2D-mask forward's (bit for bit on CPU: tests pin it).
Given a 2D padding mask, transformers' SDPA mask code asks on every forward whether it holds any
padding (``bool(mask.sum() == mask.numel())``), a host read that blocks on a GPU; given none,
SDPA takes its ``is_causal`` path (on CUDA the flash kernel, and no ``[L, L]`` mask in memory).
Padding positions' outputs differ; nothing reads them (the loss mask is 0 there).

``CAUSAL_SDPA`` is transformers' SDPA attention under a mask function that returns no mask for a
plain causal forward without a KV cache (query and keys the same positions), and transformers'
own SDPA mask otherwise (a cache, a sliding window, packed sequences). It is for right-padded
rows only: a left-padded prompt (the engines' layout) would attend to its padding, so only the
trainer's models (and the reference role's) take it. Models on another attention than SDPA are
left alone. The choice lives in the model's config in memory; ``save_pretrained`` writes none of it.
"""

from __future__ import annotations

import functools

CAUSAL_SDPA = "causal_sdpa"  # no "flash" in the name: transformers reads that as a flash-attention kernel


def causal_sdpa_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    local_size: int | None = None,
    **kwargs,
):
    """None (SDPA's ``is_causal``) for a plain causal forward over fresh positions; else
    transformers' SDPA mask. Reads nothing from the device."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    mask_function = mask_function or causal_mask_function
    plain = mask_function is causal_mask_function and local_size is None
    if plain and q_offset == 0 and kv_offset == 0 and q_length == kv_length:
        return None
    return sdpa_mask(
        batch_size,
        q_length,
        kv_length,
        q_offset,
        kv_offset,
        mask_function=mask_function,
        local_size=local_size,
        **kwargs,
    )


@functools.cache
def _register() -> None:
    """Name ``CAUSAL_SDPA`` in transformers' attention and mask registries (once per process;
    transformers loads on first use, so importing this module loads none of it)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    AttentionMaskInterface.register(CAUSAL_SDPA, causal_sdpa_mask)


def causal_attention(model):
    """Switch ``model`` (a right-padded batch's forward) from SDPA to ``CAUSAL_SDPA``; returns it."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == "sdpa":
        _register()
        model.set_attn_implementation(CAUSAL_SDPA)
    return model
