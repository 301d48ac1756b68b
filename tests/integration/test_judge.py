"""The ``judge`` reward: an LLM judge in a flash torch engine. Its verdict equals the judge model's
own greedy continuation (computed independently with Hugging Face ``generate``), parsed by the
rule; timeouts, unparseable text and engine errors score 0 with named reasons, counted; at most
``max_concurrent`` verdicts run at once; the registry and the config validate its knobs."""

import re
import threading

import pytest
import torch

from flash.errors import ConfigError
from flash.models import (
    TinyModelConfig,
    build_tiny_model,
    build_tokenizer,
    decode_response,
    encode_prompt,
)
from flash.rewards import build_reward, registered_rewards
from flash.rewards.judge import JudgeReward, parse_verdict, with_default_model
from flash.tasks import TaskItem

TEMPLATE = "q: {prompt} a: {response} ref: {answer} ok?"
ITEM = TaskItem(0, "tom has 3 apples and buys 4 more. how many apples now?", "7")


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    """A seeded random tiny Qwen2 + the byte tokenizer: greedy decoding makes its text fixed."""
    out = tmp_path_factory.mktemp("judge")
    tok = build_tokenizer()
    model = build_tiny_model(
        tok, TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=128, seed=3)
    )
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def hf_greedy(model_dir: str, text: str, max_new_tokens: int) -> str:
    """The judge's verdict text computed without flash's engine (reference)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([encode_prompt(tok, text)])
    with torch.no_grad():
        gen = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    return decode_response(tok, gen[0, ids.shape[1] :].tolist())


def make(judge_dir, **knobs) -> JudgeReward:
    section = {"name": "judge", "model": judge_dir, "template": TEMPLATE, "max_new_tokens": 6, **knobs}
    return build_reward(section)


def test_parse_rule_on_hand_written_verdicts():
    yes_no = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
    assert parse_verdict("Yes, it is", yes_no, {"yes": 1.0, "no": 0.0}, 1.0) == 1.0
    assert parse_verdict("no.", yes_no, {"yes": 1.0, "no": 0.0}, 1.0) == 0.0
    assert parse_verdict("maybe", yes_no, {"yes": 1.0, "no": 0.0}, 1.0) is None
    score = re.compile(r"score: (\d+)")
    assert parse_verdict("score: 7 of 10", score, None, 0.1) == pytest.approx(0.7)
    assert parse_verdict("score: x", score, None, 0.1) is None


def test_verdict_equals_the_judge_models_greedy_text(judge_dir):
    response = "3+4=7"
    text = hf_greedy(judge_dir, TEMPLATE.format(prompt=ITEM.prompt, response=response, answer="7"), 6)
    assert text, "the reference judge produced no text"
    first = text[0]
    # a parse rule keyed on the judge's first character: only its exact verdict scores 0.25
    judge = make(judge_dir, pattern="^(.)", scores={first: 0.25})
    try:
        result = judge(ITEM, response)
        assert (result.reward, result.reason) == (0.25, "ok")
        again = judge(ITEM, response)  # temperature 0: deterministic
        assert again.reward == 0.25
        assert judge.metrics()["judge/calls"] == 2.0
    finally:
        judge.server.close()


def test_failures_score_zero_with_named_reasons_and_are_counted(judge_dir, monkeypatch):
    import flash.models

    judge = make(judge_dir, pattern="(zzzz)", timeout_s=5.0)
    try:
        r = judge(ITEM, "7")
        assert (r.reward, r.reason) == (0.0, "judge:unparseable")
        r = judge(ITEM, "SEVEN\n\t")  # any text encodes (byte tokenizer)
        assert (r.reward, r.reason) == (0.0, "judge:unparseable")

        def unencodable(tokenizer, text):
            raise ValueError("the tokenizer has no token for some bytes")

        with monkeypatch.context() as patch:  # the encode fails: a named error
            patch.setattr(flash.models, "_encode_bytes", unencodable)
            r = judge(ITEM, "7")
        assert (r.reward, r.reason) == (0.0, "judge:error:ValueError")
        m = judge.metrics()
        assert m["judge/calls"] == 3.0 and m["judge/judge/unparseable"] == 2.0
    finally:
        judge.server.close()
    slow = make(judge_dir, pattern="(.)", max_new_tokens=200, timeout_s=1e-4)
    try:
        r = slow(ITEM, "7")
        assert (r.reward, r.reason) == (0.0, "judge:timeout")
        assert slow.server.loop.stats() is not None  # the engine loop is still alive after the abort
        assert slow.server.inflight == 0
    finally:
        slow.server.close()


def test_at_most_max_concurrent_verdicts_at_once(judge_dir):
    judge = make(judge_dir, pattern="(.)", max_new_tokens=30, max_concurrent=2, timeout_s=60.0)
    try:
        results = []
        threads = [threading.Thread(target=lambda: results.append(judge(ITEM, "7"))) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 6 and not [r for r in results if r.reason in ("judge:timeout", "judge:error")]
        assert judge.server.max_inflight == 2  # reached, never passed
    finally:
        judge.server.close()


def test_registered_and_validated():
    from flash.app.config import load_config

    assert "judge" in registered_rewards()
    with pytest.raises(ValueError, match="needs 'model'"):
        build_reward({"name": "judge"})
    with pytest.raises(ConfigError, match="unknown fields"):
        load_config("recipes/math.yaml", ["reward.fn.name=judge", "reward.fn.template='{question}'"])
    with pytest.raises(ConfigError, match="did you mean 'pattern'"):
        load_config("recipes/math.yaml", ["reward.fn.name=judge", "reward.fn.patern=x"])
    cfg = load_config("recipes/math.yaml", ["reward.fn.name=judge"])  # model filled in by the run
    assert with_default_model(dict(cfg.reward.fn), "/ckpt")["model"] == "/ckpt"
    assert with_default_model({"name": "judge", "model": "/j"}, "/ckpt")["model"] == "/j"
    assert "model" not in with_default_model({"name": "math"}, "/ckpt")


@pytest.mark.slow
@pytest.mark.margin  # the suite keeps under 45 min: the judge's scoring and knobs are pinned above without a run
def test_math_recipe_runs_two_steps_with_the_judge(tmp_path):
    """`reward.fn.name: judge` end to end: the judge (the policy's initial checkpoint, the default)
    scores every trained and evaluated response through the reward pool; the run finishes."""
    import json

    import ray

    from flash.app.config import load_config
    from flash.app.runner import run

    overrides = [
        f"run_dir={tmp_path / 'run'}",
        f"cache_dir={tmp_path / 'cache'}",
        "tracking.progress=false",
        "sft.steps=20",
        "sft.eval_after=false",
        "task.eval_size=4",
        "train.steps=2",
        "train.prompts_per_step=2",
        "rollout.n=2",
        "reward.fn.name=judge",
        "reward.fn.pattern='([0-9])'",
        "reward.fn.scale=0.1",
        "reward.fn.max_new_tokens=4",
        "reward.fn.template='q: {prompt} a: {response} score:'",
        "checkpoint.enabled=false",
    ]
    cfg = load_config("recipes/math.yaml", overrides)
    try:
        s = run(cfg, "math")
    finally:
        if ray.is_initialized():
            ray.shutdown()
    assert s["steps"] == 2 and s["samples_trained"] == 2 * 2 * 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    # the reward pool's CPU per step (the judge's engine runs in the reward worker): counted, never negative
    per_step = [r["reward/cpu_s"] for r in rows if "time/step" in r]
    assert len(per_step) == 2 and min(per_step) >= 0 and sum(per_step) > 0
    # every call reached the judge; failures, if any, are the judge's named ones. The judge counts a
    # call when it has scored it, the pool when the result is back: at async_ratio 1 rollout goes on
    # while the step is logged, so the snapshot may hold calls between the two (at most one per slot)
    slots = last["reward/workers"] * cfg.reward.concurrency
    assert last["reward/calls"] >= 2 * 2 * 2 + 4
    assert last["reward/calls"] <= last["judge/calls"] <= last["reward/calls"] + slots
    assert all(k.startswith("reward/failures/judge:") for k in last if k.startswith("reward/failures/"))
    assert 1 <= last["judge/max_inflight"] <= 4
