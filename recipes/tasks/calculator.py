"""``calculator``: word problems an agent solves by calling a calculator tool through the gateway.

Example (the tiny model's chat template, one line; ``<eos>`` ends each assistant turn)::

    tools: calc. q: ann has 7 bags with 8 cards each. how many cards in all? a: <tool_call>{"name":
    "calc", "arguments": {"expr": "7*8"}}</tool_call><eos> r: 56 a: 56<eos>

The agent (``solve``) is what a user writes: an ``openai.AsyncOpenAI`` chat loop that offers the
``calc`` tool, runs each call the model makes (``calc`` parses ``a+b``, ``a-b`` or ``a*b``, never
``eval``), sends the result back as a ``tool`` message and scores the final answer with the
``math`` reward (math-verify). The gateway renders ``tools`` and the tool turns with the template
below and parses ``<tool_call>`` blocks (the ``hermes`` parser) into ``tool_calls``.

Why RL has room after the warm start: the multiplication table is beyond what the tiny model learns
in a warm start (``wordproblems`` with products to 81: 24 % greedy after 400 SFT steps), while
copying one-digit operands into a call is within it (``wordproblems`` copies them into its
equations), so an answer without the tool is mostly a guess; the demonstrations skip the tool and
guess (a wrong value) with probability ``skip_prob``. Larger operands (``max_operand``) make the
tool more necessary and the copying harder: two-digit operands were not copied after 1200 SFT
steps. The warm-started policy calls the tool about
``1 - skip_prob`` of the time and is right mostly then; the reward teaches it to call the tool
every time. Demonstrations are chats (``{"messages", "tools"}``), one turn each: the call, or the
answer after the tool's result, encoded through the chat template exactly as the gateway renders
them (flash.train.sft).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

from flash.envs.agents import TOOL_TEMPLATE as TEMPLATE
from flash.tasks import Task, TaskItem, register_task
from .wordproblems import NAMES, THINGS, evaluate, story

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "the value of one arithmetic operation, e.g. 23*17",
            "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]},
        },
    }
]
EXPR = re.compile(r"\s*(\d{1,6})\s*([+*-])\s*(\d{1,6})\s*")
MAX_CALLS = 3


@dataclass(frozen=True)
class CalculatorOptions:
    """Options of ``calculator`` (the keys a recipe's ``task:`` block accepts)."""

    seed: int = 0
    min_operand: int = 2
    max_operand: int = 9
    ops: str = "*"
    skip_prob: float = 0.5  # probability that a demonstration answers without the tool (a wrong guess)
    eval_size: int = 64

    def __post_init__(self) -> None:
        if not 1 <= self.min_operand <= self.max_operand <= 999:
            raise ValueError(f"need 1 <= min_operand <= max_operand <= 999, got {self.min_operand}, {self.max_operand}")
        if not self.ops or any(op not in "+-*" for op in self.ops):
            raise ValueError(f"ops must be a non-empty subset of '+-*', got {self.ops!r}")
        if not 0.0 <= self.skip_prob < 1.0:
            raise ValueError(f"skip_prob must be in [0, 1), got {self.skip_prob}")
        if self.eval_size < 1:
            raise ValueError(f"eval_size must be >= 1, got {self.eval_size}")


def calc(expr: str) -> str:
    """The tool: ``a op b`` for non-negative integers, else an error the model sees."""
    m = EXPR.fullmatch(expr) if isinstance(expr, str) else None
    if m is None:
        return "error"
    return str(evaluate(m[2], int(m[1]), int(m[3])))


def call_text(expr: str) -> str:
    """A call to ``calc`` as the template renders it (and the model writes it)."""
    return f'<tool_call>{{"name": "calc", "arguments": {json.dumps({"expr": expr})}}}</tool_call>'


def call_message(expr: str) -> dict:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "calc", "arguments": {"expr": expr}}}],
    }


@register_task("calculator")
class Calculator(Task):
    """Word problems for a tool-using agent (see the module docstring)."""

    Options = CalculatorOptions
    chat_template = TEMPLATE

    def _make_item(self, index: int, split: str, rng: random.Random) -> TaskItem:
        o = self.options
        op = rng.choice(o.ops)
        a, b = rng.randint(o.min_operand, o.max_operand), rng.randint(o.min_operand, o.max_operand)
        if op == "-" and b > a:
            a, b = b, a
        prompt = story(op, a, b, rng.choice(NAMES), rng.choice(THINGS), rng)
        return TaskItem(
            index=index, prompt=prompt, answer=str(evaluate(op, a, b)), meta={"expr": f"{a}{op}{b}", "split": split}
        )

    def max_response_tokens(self) -> int:
        top = self.options.max_operand
        return len(call_text(f"{top}*{top}")) + 1  # the longest call, then <eos>

    def reward(self, item: TaskItem, response: str) -> float:
        from flash.rewards.builtin import math_reward

        return math_reward(item, response)

    def sft_pair(self, index: int) -> tuple[dict, str]:
        """One turn of train item ``index``'s demonstration, each half the time: the first turn (the
        call; a direct guess instead with probability ``skip_prob``), or the answer after the tool's
        result."""
        item = self.item(index, "train")
        rng = self.rng(index, "train", stream="demo")
        first = [{"role": "user", "content": item.prompt}]
        if rng.random() < 0.5:  # the first turn: a call, or a guess
            if rng.random() < self.options.skip_prob:
                guess = int(item.answer) + rng.choice((-1, 1)) * rng.randint(1, 9)
                return {"messages": first, "tools": TOOLS}, str(abs(guess))
            return {"messages": first, "tools": TOOLS}, call_text(item.meta["expr"])
        result = {"role": "tool", "tool_call_id": "call_0", "content": calc(item.meta["expr"])}
        return {"messages": first + [call_message(item.meta["expr"]), result], "tools": TOOLS}, item.answer


async def solve(client, item) -> tuple[float, dict]:
    """The agent: offer ``calc``, run the calls the model makes, score its final answer."""
    from flash.rewards.builtin import math_reward

    messages, calls = [{"role": "user", "content": item.prompt}], 0
    for _ in range(MAX_CALLS):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        msg = reply.choices[0].message
        if not msg.tool_calls:
            return math_reward(item, msg.content or ""), {"tool_calls": calls}
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            calls += 1
            try:
                expr = json.loads(call.function.arguments).get("expr", "")
            except (ValueError, AttributeError):
                expr = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calc(expr)})
    return 0.0, {"tool_calls": calls}
