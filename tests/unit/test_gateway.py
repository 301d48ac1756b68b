"""The agent gateway with the real ``openai`` client and a real engine: every turn is token-exact.

Three tokenizers and chat templates: flash's character tokenizer with a ChatML-like template (its
``<bos>`` opens a turn, its ``<eos>`` closes one and a space follows: a non-empty tail after the
stop token), a byte-level BPE trained here with a Llama-3-like template (nothing after
``<|eot_id|>``), and a template that renders only the last four messages (not append-only: once
the window slides, a call must start a new segment). The engine is ``TorchEngine`` over a tiny
random model; a small blocking ``generate`` logs what the engine got and sampled, which is what
each session's segments are checked against.
"""

from __future__ import annotations

import asyncio
import math
import threading

import httpx
import openai
import pytest
import torch

from flash.engine.base import GenerationRequest, check_request, error_output
from flash.engine.torch_engine import TorchEngine
from flash.envs.chat_session import ChatSession, Turn, record, render, turn_tail
from flash.envs.gateway import Gateway
from flash.models import TinyModelConfig, build_tiny_model
from tests.helpers.chat import CHATML, WINDOW, bpe_tokenizer
from tests.helpers.models import make_model

OPENING = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is the weather"}]
FOLLOW_UPS = [
    {"role": "tool", "content": "sunny 21"},
    {"role": "user", "content": "and tomorrow?"},
    {"role": "user", "content": "thanks"},
]
MAX_CONTEXT = 256
MAX_TOKENS = (16, 1, 16, 3)  # per turn: long replies end on the stop token, short ones by length


def setup_parts(name: str):
    """(tokenizer, model) for one of the three setups. The model's end-of-turn logit is raised
    (by about log(vocab / 2) at temperature 1.5) so that replies end on the stop token about as
    often as they run out of tokens: both ways of closing a turn are exercised."""
    if name == "llama3":
        tok = bpe_tokenizer()
        cfg = TinyModelConfig(
            hidden_size=64,
            num_layers=2,
            num_heads=2,
            num_kv_heads=1,
            intermediate_size=128,
            max_positions=MAX_CONTEXT,
            seed=5,
        )
        model = build_tiny_model(tok, cfg).eval()
    else:
        tok, model = make_model(seed=7)
        tok.chat_template = CHATML if name == "chatml" else WINDOW
    bias = torch.zeros(model.config.vocab_size)
    bias[tok.eos_token_id] = 1.5 * math.log(len(tok) / 8)
    model.lm_head.register_forward_hook(lambda _module, _inputs, logits: logits + bias)
    return tok, model


class Policy:
    """The gateway's blocking ``generate``: one request at a time on a real engine, all logged."""

    def __init__(self, model):
        self.engine = TorchEngine(model, max_num_seqs=4, seed=0)
        self.vocab = model.config.vocab_size
        self.lock = threading.Lock()
        self.log: list[tuple[str, list[int], object]] = []  # (session key, prompt, output)

    def __call__(self, prompt_ids, params, key):
        with self.lock:
            req = GenerationRequest(f"gw-{len(self.log)}", list(prompt_ids), params)
            why = check_request(req, vocab_size=self.vocab, max_context=MAX_CONTEXT)
            out = error_output(req, why) if why else self.engine.generate([req])[0]
            self.log.append((key, list(prompt_ids), out))
            return out

    def calls(self, key: str) -> list[tuple[list[int], object]]:
        return [(p, o) for k, p, o in self.log if k == key and o.finish_reason != "error"]


@pytest.fixture(scope="module", params=["chatml", "llama3", "window"])
def served(request):
    tok, model = setup_parts(request.param)
    policy = Policy(model)
    with Gateway(tok, policy, max_tokens_cap=24, max_body_bytes=64 * 1024) as gw:
        yield request.param, tok, policy, gw


@pytest.fixture(scope="module")
def chatml():
    tok, model = setup_parts("chatml")
    policy = Policy(model)
    with Gateway(tok, policy, max_tokens_cap=24, max_body_bytes=64 * 1024) as gw:
        yield tok, policy, gw


def client(gw: Gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url, api_key=key, max_retries=0, timeout=60)


def converse(ask, turns: int) -> list[list[dict]]:
    """A conversation of ``turns`` calls (tool and user turns between them); returns the messages
    each call was sent. ``ask(messages, turn)`` returns the reply text."""
    messages, sent = list(OPENING), []
    for i in range(turns):
        sent.append(list(messages))
        reply = ask(messages, i)
        messages += [{"role": "assistant", "content": reply}, FOLLOW_UPS[i % len(FOLLOW_UPS)]]
    return sent


def assert_token_exact(rec: dict, calls: list[tuple[list[int], object]]) -> None:
    """Each call's sampled ids sit, in order and exactly, at the mask-1 positions of its segment,
    with their logprobs and versions; every mask-1 token is a sampled one; the context before
    each call is exactly the prompt the engine got."""
    assert len(calls) == len(rec["calls"])
    for s, seg in enumerate(rec["segments"]):
        mine = [c for c, meta in zip(calls, rec["calls"]) if meta["segment"] == s]
        assert mine and mine[0][0] == seg.prompt_ids
        tokens, start = seg.tokens, len(seg.prompt_ids)
        sampled = set()
        for prompt, out in mine:
            n, end = len(prompt), len(prompt) + len(out.token_ids)
            assert tokens[:n] == prompt
            assert tokens[n:end] == out.token_ids
            assert seg.logprobs[n - start : end - start] == out.logprobs
            assert seg.versions[n - start : end - start] == out.versions
            sampled |= set(range(n - start, end - start))
        assert end == len(tokens)
        assert {i for i, m in enumerate(seg.loss_mask) if m} == sampled
        assert len(seg.loss_mask) == len(seg.response_ids) == len(seg.logprobs) == len(seg.versions)


def test_turns_are_token_exact_and_follow_the_template(served):
    name, tok, policy, gw = served
    key = gw.open_session({"task": name})
    api = client(gw, key)

    def ask(messages, turn):
        r = api.chat.completions.create(
            model="policy", messages=messages, max_tokens=MAX_TOKENS[turn], seed=100 + turn, temperature=1.5
        )
        out = policy.calls(key)[-1][1]
        assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (len(out.token_ids), out.finish_reason)
        return r.choices[0].message.content

    sent = converse(ask, 4)
    rec = gw.close_session(key)
    calls = policy.calls(key)
    assert_token_exact(rec, calls)
    assert rec["meta"] == {"task": name} and rec["tokens_out"] == sum(len(o.token_ids) for _, o in calls)
    for messages, (prompt, _) in zip(sent, calls):  # what the engine saw reads as the template's text
        assert tok.decode(prompt, skip_special_tokens=True) == tok.decode(
            render(tok, messages, None, True), skip_special_tokens=True
        )
    starts = [c["new_segment"] for c in rec["calls"]]
    if name == "window":  # 2, 4, 6, 8 messages: the last two calls see a slid window
        assert starts == [True, False, True, True] and rec["new_segments"] == 2
        assert all(seg.prompt_ids == render(tok, m, None, True) for seg, m in zip(rec["segments"][1:], sent[2:]))
    else:
        assert starts == [True, False, False, False] and rec["new_segments"] == 0
    assert {c["finish_reason"] for c in rec["calls"]} == {"stop", "length"}  # both ways to close a turn
    with pytest.raises(openai.AuthenticationError):
        ask(sent[0], 1)


def test_tail_after_the_stop_token_and_after_a_length_cut():
    eos, sp, a, b = 2, 40, 14, 15
    chatml_turn = [a, b, eos, sp]  # the template's rendering of the reply "ab"
    assert turn_tail(chatml_turn, [a, b, eos], [eos]) == [sp]  # sampled <eos>, template adds " "
    assert turn_tail(chatml_turn, [a, b], [eos]) == [eos, sp]  # cut by length: close the turn
    assert turn_tail([a, eos, b, eos], [a, eos], [eos]) == []
    assert turn_tail([a, eos, b, eos, sp], [b, eos], [eos]) == [sp]  # the last occurrence counts
    assert turn_tail([a, b, 9], [a, b, eos], [eos]) is None  # the template never closes with <eos>
    assert turn_tail([a, b], [a, b], [eos]) is None
    llama_turn = [a, b, 4]
    assert turn_tail(llama_turn, [a, b, 4], [4]) == [] and turn_tail(llama_turn, [a], [4]) == [4]


def test_context_tokens_take_the_version_of_the_next_sampled_token():
    session = ChatSession()
    record(session, Turn([1, 5], [1, 5], True, "chat"), [6, 2], [-0.5, -0.1], [2, 2], "x")
    record(session, Turn([1, 5, 6, 2, 40, 9], [40, 9], False, "chat"), [7], [-0.3], [3], "y")
    (seg,) = session.segments
    assert seg.response_ids == [6, 2, 40, 9, 7] and seg.loss_mask == [1, 1, 0, 0, 1]
    assert seg.logprobs == [-0.5, -0.1, 0.0, 0.0, -0.3] and seg.versions == [2, 2, 3, 3, 3]
    sample = seg.to_sample(
        prompt_id=4, sample_index=1, reward=1.0, finish_reason="length", admitted_version=2, meta={"k": 1}
    )
    assert sample.prompt_ids == [1, 5] and sample.response_ids == seg.response_ids
    assert sample.loss_mask == seg.loss_mask and sample.behav_logprobs == seg.logprobs and sample.version == 2
    assert sample.meta == {"k": 1}
    with pytest.raises(ValueError):
        record(session, Turn([1], [1], True, "chat"), [], [], [], "")


def test_an_edited_history_starts_a_new_segment(chatml):
    tok, policy, gw = chatml
    key = gw.open_session()
    api = client(gw, key)
    messages = list(OPENING)
    r1 = api.chat.completions.create(model="p", messages=messages, max_tokens=8, seed=1)
    messages += [
        {"role": "assistant", "content": r1.choices[0].message.content + "x"},  # edited reply
        {"role": "user", "content": "go on"},
    ]
    r2 = api.chat.completions.create(model="p", messages=messages, max_tokens=8, seed=2)
    messages += [
        {"role": "assistant", "content": r2.choices[0].message.content},
        {"role": "user", "content": "use a tool"},
    ]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    api.chat.completions.create(model="p", messages=messages, max_tokens=8, seed=3, tools=tools)  # new tools
    rec = gw.close_session(key)
    assert [c["new_segment"] for c in rec["calls"]] == [True, True, True] and rec["new_segments"] == 2
    assert rec["segments"][1].prompt_ids == render(tok, messages[:4], None, True)
    assert_token_exact(rec, policy.calls(key))


def test_context_is_dated_by_the_call_after_a_weight_update(chatml):
    _, policy, gw = chatml
    key = gw.open_session()
    api = client(gw, key)
    first = api.chat.completions.create(model="p", messages=OPENING, max_tokens=4, seed=6)
    with policy.lock:  # between two calls, as the controller's weight push would land
        v = policy.engine.version
        policy.engine.update_weights({}, v + 1)
    messages = OPENING + [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "go on"},
    ]
    api.chat.completions.create(model="p", messages=messages, max_tokens=4, seed=7)
    (seg,) = gw.close_session(key)["segments"]
    n = first.usage.completion_tokens
    assert seg.versions == [v] * n + [v + 1] * (len(seg.versions) - n) and seg.loss_mask[n] == 0
    assert (
        seg.to_sample(
            prompt_id=0, sample_index=0, reward=0.0, finish_reason="stop", admitted_version=v, meta={}
        ).version
        == v
    )


def test_text_completions_extend_only_an_exact_continuation(chatml):
    tok, policy, gw = chatml
    key = gw.open_session()
    api = client(gw, key)
    first = api.completions.create(model="p", prompt="count: 1 2 3", max_tokens=6, seed=3, temperature=1.5)
    said = "count: 1 2 3" + first.choices[0].text
    api.completions.create(model="p", prompt=said + " and on", max_tokens=6, seed=4)
    api.completions.create(model="p", prompt="count: 4", max_tokens=6, seed=5)  # not a continuation
    rec = gw.close_session(key)
    calls = policy.calls(key)
    assert [c["new_segment"] for c in rec["calls"]] == [True, False, True] and rec["new_segments"] == 1
    assert calls[0][0] == tok.encode("count: 1 2 3", add_special_tokens=False)
    assert calls[1][0] == calls[0][0] + calls[0][1].token_ids + tok.encode(" and on", add_special_tokens=False)
    assert_token_exact(rec, calls)


def test_bad_requests_are_refused_and_the_server_keeps_serving(chatml):
    _, _, gw = chatml
    key = gw.open_session()
    api, before = client(gw, key), gw.metrics()
    ok = {"model": "p", "messages": OPENING, "max_tokens": 4}
    refusals = [
        (openai.AuthenticationError, "unauthorized", client(gw, "not-a-key"), {}),
        (openai.BadRequestError, "unsupported", api, {"logit_bias": {"5": 1.0}}),
        (openai.BadRequestError, "unsupported", api, {"n": 2}),
        (openai.BadRequestError, "unsupported", api, {"stop": ["."]}),
        (openai.BadRequestError, "unsupported", api, {"presence_penalty": 0.5}),
        (openai.BadRequestError, "max_tokens", api, {"max_tokens": 0}),
        (openai.BadRequestError, "max_tokens", api, {"max_tokens": 25}),
        (openai.BadRequestError, "bad_params", api, {"top_p": 0}),
        (openai.BadRequestError, "bad_messages", api, {"messages": "hi"}),
        (openai.BadRequestError, "bad_messages", api, {"messages": [{"role": "wizard", "content": "x"}]}),
        (openai.BadRequestError, "bad_messages", api, {"messages": [{"role": "user", "content": 3}]}),
        (openai.BadRequestError, "bad_messages", api, {"messages": [{"role": "user", "content": "x", "a": 1}]}),
        (openai.APIStatusError, "too_large", api, {"messages": [{"role": "user", "content": "a" * 70_000}]}),
    ]
    for error, reason, who, change in refusals:
        with pytest.raises(error) as caught:
            who.chat.completions.create(**{**ok, **change})
        assert caught.value.body["code"] == reason, change
        assert "\n" not in caught.value.body["message"]
    assert caught.value.status_code == 413
    for body in (b"{not json", b'{"model": "p", "messages": [], "temperature": NaN}'):  # no client sends these
        raw = httpx.post(f"{gw.url}/chat/completions", content=body, headers={"Authorization": f"Bearer {key}"})
        assert raw.status_code == 400 and raw.json()["error"]["code"] == "bad_json"
    reply = api.chat.completions.create(**ok)  # still serving
    assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens >= 1
    assert [m.id for m in api.models.list().data] == ["flash-policy"]
    gw.close_session(key)
    with pytest.raises(openai.AuthenticationError):
        api.chat.completions.create(**ok)
    after = gw.metrics()
    counted = {k: after[k] - before.get(k, 0) for k in after if k.startswith("refused/")}
    assert {k: v for k, v in counted.items() if v} == {
        "refused/unauthorized": 2,
        "refused/unsupported": 4,
        "refused/max_tokens": 2,
        "refused/bad_params": 1,
        "refused/bad_json": 2,
        "refused/bad_messages": 4,
        "refused/too_large": 1,
    }
    assert after["calls"] == before["calls"] + 1


def test_engine_refusals_and_failures_are_answered_not_raised(chatml):
    tok, policy, gw = chatml
    key = gw.open_session()
    api = client(gw, key)
    with pytest.raises(openai.BadRequestError, match="exceeds the context"):  # the engine's own check
        api.chat.completions.create(model="p", messages=[{"role": "user", "content": "a" * 250}], max_tokens=8)

    def broken(prompt_ids, params, session_key):
        raise RuntimeError("engine down")

    def trimming(prompt_ids, params, session_key):  # a wiring bug: the engine sees another prompt
        return policy(prompt_ids[1:], params, session_key)

    for generate, error, reason in (
        (broken, "engine down", "generate"),
        (trimming, "different prompt", "engine_output"),
    ):
        with Gateway(tok, generate, max_tokens_cap=8) as down:
            with pytest.raises(openai.InternalServerError, match=error):
                client(down, down.open_session()).chat.completions.create(model="p", messages=OPENING)
            assert down.metrics()[f"refused/{reason}"] == 1 and down.metrics()["calls"] == 0
        with pytest.raises(RuntimeError, match="closed"):
            down.start()
    assert gw.close_session(key)["calls"] == []


def test_only_loopback_unless_remote_is_allowed(chatml):
    tok, policy, _ = chatml
    with pytest.raises(ValueError, match="allow_remote"):
        Gateway(tok, policy, host="0.0.0.0")
    Gateway(tok, policy, host="0.0.0.0", allow_remote=True).close()  # built, never started
    for host in ("127.0.0.1", "localhost", "::1"):
        Gateway(tok, policy, host=host)


def test_concurrent_sessions_stay_separate(chatml):
    tok, policy, gw = chatml
    keys = [gw.open_session({"agent": i}) for i in range(3)]

    async def agent(i: int) -> list[list[dict]]:
        api = openai.AsyncOpenAI(base_url=gw.url, api_key=keys[i], max_retries=0, timeout=60)
        messages = [{"role": "user", "content": f"agent {i} here"}]
        for turn in range(3):
            r = await api.chat.completions.create(
                model="p", messages=messages, max_tokens=6, seed=10 * i + turn, temperature=1.5
            )
            messages += [
                {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": f"more {turn}"},
            ]
        await api.close()
        return messages

    async def agents() -> list:
        return await asyncio.gather(*(agent(i) for i in range(3)))

    asyncio.run(agents())
    for i, key in enumerate(keys):
        rec = gw.close_session(key)
        assert rec["meta"] == {"agent": i} and len(rec["calls"]) == 3 and rec["new_segments"] == 0
        assert_token_exact(rec, policy.calls(key))
        assert tok.decode(rec["segments"][0].prompt_ids).startswith(f"<bos>user:agent {i} here")
