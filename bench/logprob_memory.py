"""Peak memory of one trainer micro-batch at a large vocabulary, traced on CPU (no GPU needed).

    python -m bench.logprob_memory [--rows 8] [--length 1024] [--prompt 256] [--vocab 151936]

Under ``FakeTensorMode`` (no byte is allocated, every op still runs its shape logic) with
``torch.distributed._tools.mem_tracker.MemTracker`` counting every live tensor, one micro-batch of
``rows × length`` tokens (the first ``prompt`` of each a prompt) goes through the trainer's own
``Trainer._micro_loss`` (forward, ``flash.train.logprobs.token_logprobs``, the PPO loss and its
metrics) and ``backward``. The stand-in model is Qwen2.5-0.5B's shape with one decoder layer
(hidden 896, tied 151,936-id embedding): the vocabulary projection and what follows it dominate,
as in the real model, while the other 23 layers' activations (which activation checkpointing
bounds) stay out of the figure.

Measured per precision (``model.dtype`` float32, and bfloat16 under autocast) with the entropy
computed (a logging step or an entropy bonus) and without it (``train.entropy_every_steps``
skipping the step), and for ``unchunked``: the same step with the logprobs taken in one pass over
every position (full-vocabulary fp32 ``log_softmax`` of the whole micro-batch, the entropy on
every step). Prints GiB per case; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
from contextlib import nullcontext
from unittest import mock

import torch
import torch.nn.functional as F

GIB = 2**30


def unchunked_logprobs(model, batch, temperature, with_entropy=False, entropy_grad=True, dtype=None, *_, **__):
    """Logprobs and entropy of every position in one pass (the comparison point)."""
    from flash.devices import autocast

    with autocast(batch.input_ids.device, dtype):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    logits = logits[:, :-1].float() / temperature  # held until the end, as one pass holds it
    logp_all = F.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def stand_in_config(vocab: int, layers: int = 1):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    )


def micro_batch_peak(
    rows: int = 8,
    length: int = 1024,
    prompt: int = 256,
    vocab: int = 151936,
    dtype: str = "float32",
    entropy: bool = True,
    unchunked: bool = False,
    layers: int = 1,
    activation_checkpointing: bool = False,
) -> float:
    """Peak bytes (every tracked device) of one micro-batch's forward, loss and backward, with
    ``layers`` decoder layers, each recomputed in backward under ``activation_checkpointing``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import Qwen2ForCausalLM

    import flash.train.trainer as trainer_mod
    from flash.app.memory_trace import zero_batch
    from flash.train.trainer import Trainer, TrainerSettings

    settings = TrainerSettings(
        lr=1e-6,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        grad_clip=1.0,
        micro_batch_size=rows,
        temperature=1.0,
        loss={"name": "ppo", "old_policy": "prox"},
        agg="token-mean",
        dtype=dtype,
        entropy_every_steps=1 if entropy else 0,
        activation_checkpointing=activation_checkpointing,
    )
    with FakeTensorMode():
        model = Qwen2ForCausalLM(stand_in_config(vocab, layers))
        trainer = Trainer(model, settings)
        part, adv = zero_batch(rows, length)
        trainer.begin_step()
        tracker = MemTracker()
        tracker.track_external(model, trainer.optimizer)
        patch = mock.patch.object(trainer_mod, "token_logprobs", unchunked_logprobs) if unchunked else nullcontext()
        with patch, tracker:
            loss, _ = trainer._micro_loss(part, adv, None, None, prompt - 1)
            loss.backward()
    return float(max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151936)
    args = ap.parse_args()
    shape = {"rows": args.rows, "length": args.length, "prompt": args.prompt, "vocab": args.vocab}
    out = {"shape": shape, "gib": {}}
    for dtype in ("float32", "bfloat16"):
        for name, kw in (
            ("unchunked", {"unchunked": True}),
            ("chunked, entropy", {"entropy": True}),
            ("chunked, no entropy", {"entropy": False}),
        ):
            gib = micro_batch_peak(**shape, dtype=dtype, **kw) / GIB
            out["gib"][f"{dtype} {name}"] = round(gib, 2)
            print(f"{dtype:9s} {name:20s} {gib:6.2f} GiB")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
