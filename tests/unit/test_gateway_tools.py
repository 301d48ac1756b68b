"""Tool calls through the gateway with the real ``openai`` client: the model's ``<tool_call>`` text
becomes ``tool_calls``, the agent's tool turns extend the session token for token, and malformed
calls, tool messages and options are refused or counted by name.

The policy here is scripted: each call of a session answers with the next text of a script,
tokenized with the calculator task's character tokenizer and chat template (the template the
tool-using recipe trains with), so the test knows exactly which tokens were sampled.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from flash.envs.chat_messages import BadMessages, ToolCallError, hermes, parse_messages, same_turns
from flash.envs.gateway import Gateway
from flash.train.sft import task_tokenizer
from flash.recipes.tasks import make_task
from flash.recipes.tasks.calculator import TOOLS, calc, call_text, solve
from tests.helpers.chat import Scripted


@pytest.fixture
def task_tok():
    task = make_task("calculator")
    return task, task_tokenizer(task)


def run_agent(gw: Gateway, item) -> tuple:
    async def go():
        key = gw.open_session()
        client = openai.AsyncOpenAI(base_url=gw.url, api_key=key, max_retries=0, timeout=30)
        try:
            return await solve(client, item), gw.close_session(key)
        finally:
            await client.close()

    return asyncio.run(go())


def test_a_tool_call_round_trip_is_one_token_exact_segment(task_tok):
    task, tok = task_tok
    item = task.item(0, "eval")
    expr, value = item.meta["expr"], item.answer
    policy = Scripted(tok, [call_text(expr), value])
    with Gateway(tok, policy, max_tokens_cap=96) as gw:
        (reward, info), rec = run_agent(gw, item)
        metrics = gw.metrics()
    assert reward == 1.0 and info == {"tool_calls": 1} and calc(expr) == value
    assert metrics["tool_calls"] == 1 and metrics["tool_parse_errors"] == 0 and metrics["new_segments"] == 0
    (seg,) = rec["segments"]
    (_, p1, o1), (_, p2, o2) = policy.log
    # the second prompt is the first prompt, the sampled call, then the template's tool turn
    tail = tok.encode(f" r: {value} a: ", add_special_tokens=False)
    assert p2 == p1 + o1.token_ids + tail
    assert seg.prompt_ids == p1 and seg.response_ids == o1.token_ids + tail + o2.token_ids
    assert seg.loss_mask == [1] * len(o1.token_ids) + [0] * len(tail) + [1] * len(o2.token_ids)
    assert [lp for lp, m in zip(seg.logprobs, seg.loss_mask) if m] == [-0.25] * (len(o1.token_ids) + len(o2.token_ids))
    assert tok.decode(p1).endswith(f"q: {item.prompt} a: ") and tok.decode(p1).startswith("<bos>tools: calc. ")


def test_the_reply_carries_openai_tool_calls(task_tok):
    _, tok = task_tok
    policy = Scripted(tok, [call_text("12*34") + call_text("5+6")])
    with Gateway(tok, policy, max_tokens_cap=160) as gw:
        api = openai.OpenAI(base_url=gw.url, api_key=gw.open_session(), max_retries=0)
        reply = api.chat.completions.create(model="p", messages=[{"role": "user", "content": "q"}], tools=TOOLS)
        plain = openai.OpenAI(base_url=gw.url, api_key=gw.open_session(), max_retries=0).chat.completions.create(
            model="p", messages=[{"role": "user", "content": "q"}], tools=TOOLS, tool_choice="none"
        )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("calc", {"expr": "12*34"}),
        ("calc", {"expr": "5+6"}),
    ]
    assert len({c.id for c in choice.message.tool_calls}) == 2
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content.startswith("<tool_call>")


def test_a_malformed_call_stays_content_and_is_counted(task_tok):
    _, tok = task_tok
    cut = call_text("12*34")[:30]
    policy = Scripted(tok, [cut], stop=False)
    with Gateway(tok, policy, max_tokens_cap=96) as gw:
        api = openai.OpenAI(base_url=gw.url, api_key=gw.open_session(), max_retries=0)
        reply = api.chat.completions.create(model="p", messages=[{"role": "user", "content": "q"}], tools=TOOLS)
        assert gw.metrics()["tool_parse_errors"] == 1 and gw.metrics()["tool_calls"] == 0
    assert reply.choices[0].message.content == cut and reply.choices[0].finish_reason == "length"


def test_bad_tool_messages_and_options_are_refused_by_name(task_tok):
    _, tok = task_tok
    policy = Scripted(tok, ["7"] * 8)
    bad_call = {
        "role": "assistant",
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "calc", "arguments": "{not json"}}],
    }
    cases = [
        ({"tool_choice": "required"}, "unsupported"),
        ({"tool_choice": {"type": "function", "function": {"name": "calc"}}}, "unsupported"),
        ({"parallel_tool_calls": False}, "unsupported"),
        ({"messages": [bad_call]}, "bad_messages"),
        ({"messages": [{"role": "user", "tool_calls": bad_call["tool_calls"], "content": "x"}]}, "bad_messages"),
        ({"messages": [{"role": "tool", "content": None}]}, "bad_messages"),
        ({"tools": "calc"}, "bad_messages"),
    ]
    with Gateway(tok, policy, max_tokens_cap=16) as gw:
        api = openai.OpenAI(base_url=gw.url, api_key=gw.open_session(), max_retries=0)
        for change, reason in cases:
            with pytest.raises(openai.BadRequestError) as caught:
                api.chat.completions.create(
                    **{"model": "p", "messages": [{"role": "user", "content": "q"}], "tools": TOOLS, **change}
                )
            assert caught.value.body["code"] == reason, change
        ok = api.chat.completions.create(
            model="p", messages=[{"role": "user", "content": [{"type": "text", "text": "q"}]}], tools=TOOLS
        )  # text parts are one string
        assert ok.choices[0].message.content == "7"


def test_hermes_parser_and_history_comparison():
    assert hermes('hi <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>') == (
        "hi",
        [{"name": "f", "arguments": {"x": 1}}],
    )
    assert hermes("just text") == ("just text", [])
    for bad in (
        '<tool_call>{"name": "f"',
        "<tool_call>[1]</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
    ):
        with pytest.raises(ToolCallError):
            hermes(bad)
    sent = parse_messages(
        [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
            }
        ]
    )
    assert sent[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1} and sent[0]["content"] == ""
    mine = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "zz", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
        }
    ]
    assert same_turns(mine, sent)  # call ids may differ
    assert not same_turns(
        mine,
        parse_messages(
            [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 2}'}}],
                }
            ]
        ),
    )
    with pytest.raises(BadMessages, match="at most"):
        parse_messages(
            [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": str(i), "type": "function", "function": {"name": "f", "arguments": "{}"}}
                        for i in range(33)
                    ],
                }
            ]
        )
    assert calc("23*17") == "391" and calc("__import__('os')") == "error" and calc("1+2+3") == "error"


def test_streamed_replies_carry_the_same_content_and_tool_calls(task_tok):
    _, tok = task_tok
    policy = Scripted(tok, [call_text("12*34"), "408", "done"])
    with Gateway(tok, policy, max_tokens_cap=96) as gw:
        key = gw.open_session()
        api = openai.OpenAI(base_url=gw.url, api_key=key, max_retries=0)
        ask = [{"role": "user", "content": "q"}]
        chunks = list(
            api.chat.completions.create(
                model="p", messages=ask, tools=TOOLS, stream=True, stream_options={"include_usage": True}
            )
        )
        calls = [c for ch in chunks if ch.choices for c in (ch.choices[0].delta.tool_calls or [])]
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("calc", {"expr": "12*34"})]
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
        assert chunks[-1].usage.completion_tokens == len(policy.log[0][2].token_ids)
        said = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": calls[0].id,
                    "type": "function",
                    "function": {"name": "calc", "arguments": calls[0].function.arguments},
                }
            ],
        }
        follow = ask + [said, {"role": "tool", "tool_call_id": calls[0].id, "content": "408"}]
        text = "".join(
            ch.choices[0].delta.content or ""
            for ch in api.chat.completions.create(model="p", messages=follow, tools=TOOLS, stream=True)
            if ch.choices
        )
        assert text == "408" and gw.metrics()["new_segments"] == 0  # the streamed turn extended the session
        done = "".join(ch.choices[0].text for ch in api.completions.create(model="p", prompt="x", stream=True))
        assert done == "done"
        with pytest.raises(openai.BadRequestError, match="stream_options"):
            api.chat.completions.create(model="p", messages=ask, stream=True, stream_options={"x": 1})
