"""The bodies of the GPU checks (tests/gpu), each taking a device: they run on CUDA there and on
CPU in the default suite (tests/integration/test_gpu_bodies.py), so they cannot rot."""

from __future__ import annotations

import contextlib
import copy
import math
import time
from contextlib import contextmanager

import pytest
import torch

from flash.algos.metrics import finalize
from flash.buffers import Sample
from flash.cluster import load_model
from flash.engine.base import GenerationRequest, SamplingParams
from flash.engine.torch_engine import TorchEngine
from flash.train.batch import batch_to, collate
from flash.train.fsdp import ShardedTrainer
from flash.train.trainer import Trainer, token_logprobs
from tests.helpers.models import PROMPTS, make_model
from tests.helpers.train import make_batch, settings, toy_model


ROWS, MICRO_BATCHES = 8, 4


@contextmanager
def sync_debug(mode: str):
    torch.cuda.synchronize()  # what came before is not the step's
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def step_under(device: torch.device, guard) -> None:
    """One step on ``device``, its parts under ``guard(mode)`` ("error": no sync allowed)."""
    trainer = Trainer(toy_model().to(device), settings(micro_batch_size=ROWS // MICRO_BATCHES), seed=0)
    batch, adv = make_batch(seed=1, n=ROWS, vocab=32)  # on the CPU, as the driver sends it
    trainer.begin_step()
    with guard("error"):  # upload; 4 micro-batches: forward, loss, backward, sums on the device
        trainer.accumulate(batch, adv, None)  # prox fused into the forward, as the default recipe runs
    with guard("default"):  # once per optimizer step: the finite check and the float metrics
        metrics = trainer.finish_step()
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0 and metrics["skipped"] == 0.0
    assert trainer.steps == 1


NEW_TOKENS, TEMPERATURE = 16, 1.0


FP32_MAX_ABS = 1e-3


BF16_MEAN_ABS, BF16_MAX_ABS = 0.05, 0.3


def engine_samples(model) -> list[Sample]:
    """The engine's rollouts of PROMPTS as training samples (behaviour logprobs as reported)."""
    engine = TorchEngine(model, max_num_seqs=len(PROMPTS), seed=0)
    reqs = [
        GenerationRequest(
            f"r{i}-{time.monotonic_ns()}", p, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=TEMPERATURE, seed=i)
        )
        for i, p in enumerate(PROMPTS)
    ]
    outs = engine.generate(reqs)
    assert all(len(o.token_ids) == NEW_TOKENS for o in outs)
    return [
        Sample(
            prompt_id=i,
            sample_index=0,
            prompt_ids=o.prompt_ids,
            response_ids=o.token_ids,
            behav_logprobs=o.logprobs,
            versions=[0] * len(o.token_ids),
            reward=0.0,
        )
        for i, o in enumerate(outs)
    ]


def mismatch(engine_model, trainer_model, autocast: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """|engine logprob - trainer logprob| on every sampled token."""
    batch = batch_to(collate(engine_samples(engine_model)), device)
    precision = torch.autocast(device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with torch.no_grad(), precision:
        logp, _ = token_logprobs(trainer_model, batch, TEMPERATURE)
    assert logp.dtype == torch.float32 and batch.behav_logp.dtype == torch.float32
    on = batch.mask > 0
    assert int(on.sum()) == NEW_TOKENS * len(PROMPTS)
    return (logp - batch.behav_logp)[on].abs()


def check_fp32_agree(device: torch.device) -> None:
    _, model = make_model(seed=5)
    trainer = model.to(device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        diff = mismatch(copy.deepcopy(trainer), trainer, autocast=None, device=device)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert diff.max() <= FP32_MAX_ABS, diff.max()


def check_bf16_within_bounds(device: torch.device) -> None:
    _, model = make_model(seed=5)
    trainer = model.to(device)  # fp32 master weights
    engine = copy.deepcopy(trainer).to(torch.bfloat16)
    diff = mismatch(engine, trainer, autocast=torch.bfloat16, device=device)
    assert diff.mean() <= BF16_MEAN_ABS and diff.max() <= BF16_MAX_ABS, (diff.mean(), diff.max())
    assert diff.max() > 0  # the engine did compute in bf16


LOSS_REL, GRAD_NORM_REL = 5e-3, 5e-3


def one_step(model_dir, mesh, dtype: str, device: torch.device) -> dict:
    tr = ShardedTrainer(load_model(model_dir), settings(dtype=dtype), mesh, device)
    batch, adv = make_batch(seed=3)
    batch, adv = batch_to(batch, device), adv.to(device)
    plan = [list(range(len(batch)))]
    return tr.planned_step(batch, adv, batch.behav_logp, plan, total=float(batch.mask.sum()))  # token-mean


def check_bf16_matches_fp32(model_dir, mesh, device: torch.device) -> None:
    fp32, bf16 = one_step(model_dir, mesh, "float32", device), one_step(model_dir, mesh, "bfloat16", device)
    loss32, loss16 = finalize(fp32["partials"])["loss"], finalize(bf16["partials"])["loss"]
    assert loss16 == pytest.approx(loss32, rel=LOSS_REL)
    assert bf16["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=GRAD_NORM_REL)
    assert loss16 != loss32
    assert fp32["grad_norm"] > 0 and bf16["skipped"] == fp32["skipped"] == 0.0


def check_push_stays_on_device(model_dir, mesh, device: torch.device, copies) -> None:
    """The 1-GPU push names no host memory (``copies``: a ``HostCopies``): an FSDP2 rank's full
    weights, gathered in bf16, stay on ``device``; the single trainer's live weights pack straight
    into a buffer on ``device``, cast in the copy. The host path lands bf16 tensors in host memory
    (through a pinned buffer where ``device`` is a GPU)."""
    from flash.train.fsdp_checkpoint import full_state_dict
    from flash.weights.gather import FlatGather
    from flash.weights.model_update import bucket_starts, pack_flat, plan_state, unpack_flat

    rank = ShardedTrainer(load_model(model_dir), settings(), mesh, device)
    want = {k: v.to(torch.bfloat16) for k, v in full_state_dict(rank.model).items()}
    cast = dict.fromkeys(want, "bfloat16")
    gather = FlatGather(rank.model)
    copies.on = True
    full = gather(dst=0, cast=cast, on_device=True)
    copies.on = False
    assert copies.host == [], copies.host
    assert {(t.device.type, t.dtype) for t in full.values()} == {(device.type, torch.bfloat16)}
    assert all(torch.equal(full[k].to("cpu"), want[k]) for k in want)
    host = gather(dst=0, cast=cast)
    assert {(t.device.type, t.dtype) for t in host.values()} == {("cpu", torch.bfloat16)}
    assert all(torch.equal(host[k], want[k]) for k in want)
    pinned = list(gather._host._pinned.values())
    assert (bool(pinned) and all(b.is_pinned() for b in pinned)) if device.type == "cuda" else not pinned
    live = Trainer(load_model(model_dir).to(device), settings()).model.state_dict()
    metas = plan_state(live, 4096, cast)
    buf = torch.empty(bucket_starts(metas)[-1], dtype=torch.uint8, device=device)
    copies.on = True
    pack_flat(live, metas, buf)
    copies.on = False
    assert copies.host == [] and copies.to == [], (copies.host, copies.to)
    views = dict(unpack_flat(buf, metas))
    assert {(v.device.type, v.dtype) for v in views.values()} == {(device.type, torch.bfloat16)}
    assert all(torch.equal(views[k], live[k].to(torch.bfloat16)) for k in live)
