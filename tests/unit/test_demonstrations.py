"""Demonstrations in a dataset column become warm-start pairs (flash/envs/demonstrations.py), one per
assistant turn, each the chat before it and the text the model writes for it; a verifiers
environment's rows supply them through ``task.sft_key`` (flash/envs/verifiers_env.py)."""

from __future__ import annotations

import json

import pytest

from flash.envs.agents import TOOL_TEMPLATE
from flash.envs.chat_messages import split_reply
from flash.envs.demonstrations import MAX_MESSAGES, DemonstrationError, demonstration_turns
from flash.models import build_tokenizer, encode_prompt

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "a times b",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]
PROMPT = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "What is 7 times 8?"}]


def call(args) -> dict:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "multiply", "arguments": args}}],
    }


EPISODE = [
    call(json.dumps({"a": 7, "b": 8})),
    {"role": "tool", "tool_call_id": "c0", "content": "56"},
    {"role": "assistant", "content": "56"},
]


def test_each_assistant_turn_is_one_pair_with_the_chat_before_it():
    pairs = demonstration_turns(PROMPT, EPISODE, TOOLS, TOOL_TEMPLATE)
    assert [len(p["messages"]) for p, _ in pairs] == [2, 4]
    assert all(p["tools"] == TOOLS for p, _ in pairs)
    (first, call_text), (second, answer) = pairs
    assert first["messages"] == PROMPT
    assert call_text == '<tool_call>{"name": "multiply", "arguments": {"a": 7, "b": 8}}</tool_call>'
    assert answer == "56"
    # the context holds the call in the template's form (arguments an object) and the tool's result
    assert second["messages"][2]["tool_calls"][0]["function"]["arguments"] == {"a": 7, "b": 8}
    assert second["messages"][3] == {"role": "tool", "content": "56", "tool_call_id": "c0"}


def test_a_demonstrated_call_is_what_the_gateway_parses_back_as_that_call():
    (_, text), _ = demonstration_turns(PROMPT, EPISODE, TOOLS, TOOL_TEMPLATE)
    content, calls, failed = split_reply("hermes", text)
    assert (
        not failed
        and content == ""
        and [(c["name"], c["arguments"]) for c in calls] == [("multiply", {"a": 7, "b": 8})]
    )


def test_the_pair_encodes_as_the_gateway_renders_the_chat():
    """The prompt of the second turn is the template's rendering of the chat up to its generation
    prompt: the tools' names, the question, the call (ended by <eos>), the tool's result, 'a: '."""
    tok = build_tokenizer()
    tok.chat_template = TOOL_TEMPLATE
    _, (prompt, _) = demonstration_turns(PROMPT, EPISODE, TOOLS, TOOL_TEMPLATE)
    text = tok.decode(encode_prompt(tok, prompt))
    assert text == (
        '<bos>tools: multiply. q: Use the tool. q: What is 7 times 8? a: <tool_call>{"name": "multiply", '
        '"arguments": {"a": 7, "b": 8}}</tool_call><eos> r: 56 a: '
    )


def test_a_string_is_the_one_reply_and_a_string_prompt_one_user_turn():
    assert demonstration_turns("What is 2 times 3?", "6", None, TOOL_TEMPLATE) == [
        ({"messages": [{"role": "user", "content": "What is 2 times 3?"}], "tools": None}, "6")
    ]


@pytest.mark.parametrize(
    "demo, error",
    [
        ([], "a demonstration is the reply"),
        (7, "got int"),
        ([{"role": "tool", "content": "56"}], "at least one assistant turn"),
        ([{"role": "wizard", "content": "x"}], "role must be one of"),
        ([call("{not json")], "arguments is not valid JSON"),
        ([call("[" * 100 + "]" * 100)], "nest"),
        ([{"role": "assistant", "content": "x", "audio": "y"}], "unsupported field"),
        ([{"role": "assistant", "content": "x"}] * (MAX_MESSAGES + 1), f"at most {MAX_MESSAGES} messages"),
        ([{"role": "assistant", "content": "x" * 70000}], "characters"),
    ],
)
def test_a_bad_demonstration_is_refused_naming_what_is_wrong(demo, error):
    with pytest.raises(DemonstrationError, match=error):
        demonstration_turns(PROMPT, demo, TOOLS, TOOL_TEMPLATE)


def test_a_template_whose_turn_does_not_follow_its_generation_prompt_is_refused():
    odd = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
    with pytest.raises(DemonstrationError, match="does not follow its generation prompt"):
        demonstration_turns(PROMPT, "56", None, odd)


class TestVerifiersRows:
    vf = pytest.importorskip("verifiers", reason="the verifiers extra")

    @pytest.fixture(scope="class")
    def task(self):
        from flash.envs.verifiers_env import VerifiersOptions, VerifiersTask

        return VerifiersTask(
            VerifiersOptions(env="recipes/envs/vf_multiply.py", sft_key="demo", args={"rows": 200, "skip_prob": 0.5})
        )

    def test_rows_give_calls_answers_and_guesses_from_the_column(self, task):
        pairs = [task.sft_pair(i) for i in range(200)]
        calls = [t for p, t in pairs if t.startswith("<tool_call>")]
        after = [(p, t) for p, t in pairs if len(p["messages"]) == 3]
        direct = [t for p, t in pairs if len(p["messages"]) == 1 and not t.startswith("<tool_call>")]
        assert len(calls) + len(after) + len(direct) == 200 and calls and after and direct
        for p, t in after:  # the answer after the tool's result is that result
            assert p["messages"][2]["role"] == "tool" and t == p["messages"][2]["content"]
        assert all(p["tools"][0]["function"]["name"] == "multiply" for p, _ in pairs)
        assert [task.sft_pair(i) for i in range(20)] == pairs[:20]  # the same index, the same pair

    def test_the_warm_start_cache_key_follows_the_rows(self, task):
        from flash.envs.verifiers_env import VerifiersOptions, VerifiersTask
        from flash.tasks import task_fingerprint

        other = VerifiersTask(
            VerifiersOptions(
                env="recipes/envs/vf_multiply.py", sft_key="demo", args={"rows": 200, "skip_prob": 0.5, "seed": 1}
            )
        )
        assert task_fingerprint(task) != task_fingerprint(other)
        assert task_fingerprint(task)["options"]["data"] == task.data_fingerprint

    @pytest.mark.parametrize(
        "key, error",
        [("", "task.sft_key names the column"), ("solution", r"no such column \(its columns: answer, demo,")],
    )
    def test_no_column_or_a_wrong_one_is_one_line_naming_the_fix(self, key, error):
        from flash.envs.verifiers_env import VerifiersOptions, VerifiersTask

        task = VerifiersTask(VerifiersOptions(env="recipes/envs/vf_multiply.py", sft_key=key, args={"rows": 8}))
        with pytest.raises(ValueError, match=error) as caught:
            task.sft_pair(0)
        assert "\n" not in str(caught.value)
