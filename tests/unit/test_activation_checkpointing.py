"""Activation checkpointing in the single trainer (``train.activation_checkpointing``): every decoder
layer runs again in backward, the gradients are bit for bit those without it (float32 and bf16
autocast on CPU), and one micro-batch's traced peak memory drops."""

from __future__ import annotations

import pytest
import torch

from bench.logprob_memory import GIB, micro_batch_peak
from flash.models import decoder_layers, is_checkpointed
from flash.train.trainer import Trainer
from tests.helpers.train import make_batch, settings, toy_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROWS, MICRO = 7, 3  # three micro-batches (3, 3, 1 rows) of the toy model's 2 decoder layers


def one_step(dtype: str, checkpointing: bool):
    """One optimizer step; the decoder-layer calls (recomputes included), gradients and metrics."""
    trainer = Trainer(
        toy_model(), settings(micro_batch_size=MICRO, dtype=dtype, activation_checkpointing=checkpointing), seed=0
    )
    calls = []
    for layer in decoder_layers(trainer.model):  # a pre-hook: a recompute stops before forward hooks
        layer.register_forward_pre_hook(lambda *_: calls.append(1))
    batch, adv = make_batch(seed=2, n=ROWS, vocab=32)
    trainer.begin_step()
    trainer.accumulate(batch, adv, None)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    return trainer, len(calls), grads, trainer.finish_step()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_checkpointed_layers_recompute_with_bit_identical_gradients(dtype):
    plain, plain_calls, g0, m0 = one_step(dtype, False)
    ckpt, ckpt_calls, g1, m1 = one_step(dtype, True)
    assert [is_checkpointed(layer) for layer in decoder_layers(ckpt.model)] == [True, True]
    assert not any(is_checkpointed(layer) for layer in decoder_layers(plain.model))
    assert (plain_calls, ckpt_calls) == (2 * 3, 2 * 3 * 2)  # 2 layers × 3 micro-batches, again in backward
    assert g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0)
    assert (m1["loss"], m1["grad_norm"]) == (m0["loss"], m0["grad_norm"]) and m0["grad_norm"] > 0


def test_checkpointing_twice_wraps_a_layer_once():
    model = toy_model()
    s = settings(activation_checkpointing=True)
    Trainer(model, s)
    classes = [type(layer) for layer in decoder_layers(model)]
    Trainer(model, s)  # an FSDP2 rank checkpoints before sharding, then its Trainer base asks again
    assert [type(layer) for layer in decoder_layers(model)] == classes
    assert [c.__mro__[1].__name__ for c in classes] == ["Qwen2DecoderLayer"] * 2


@pytest.mark.cpu_budget(4)  # two fake-tensor traces of a micro-batch's forward and backward
def test_checkpointing_lowers_one_micro_batchs_traced_peak():
    """8 × 1024 tokens through Qwen2.5-0.5B's layer shape (2 layers, a 4096-id vocabulary, no
    entropy) under FakeTensorMode + MemTracker: weights, gradients, activations, logprobs."""
    shape = dict(rows=8, length=1024, prompt=256, vocab=4096, layers=2, entropy=False)
    plain = micro_batch_peak(**shape) / GIB
    ckpt = micro_batch_peak(**shape, activation_checkpointing=True) / GIB
    assert (round(plain, 2), round(ckpt, 2)) == (2.38, 1.36)


def test_the_simulated_trainer_refuses_activation_checkpointing_by_name():
    from flash.app.config import load_config
    from flash.errors import ConfigError

    with pytest.raises(ConfigError, match="leave train.workers, micro_tokens and activation_checkpointing unset"):
        load_config("recipes/sim_rlvr.yaml", ["train.activation_checkpointing=true"])
