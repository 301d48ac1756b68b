"""A verifiers ``ToolEnv``, written as for the verifiers library: multiply two one-digit numbers
with a ``multiply`` tool (recipes/verifiers_tool.yaml runs it with ``task.name: verifiers``).

The dataset has the columns verifiers reads (``question``, ``answer``) and one it does not:
``demo``, a demonstration episode as chat messages (the tool call, its result, the answer), which
``task.sft_key: demo`` makes the tiny CPU model's warm start. With probability ``skip_prob`` a
row's demonstration answers at once with a wrong guess instead, so the warm-started model calls the
tool only part of the time and guesses otherwise; the rubric (1 for the product, else 0) teaches it
to call the tool every time. The tiny model does not learn the multiplication table in its warm
start, while copying two digits into a call is within it: without the tool an answer is a guess.
"""

import json
import random

import verifiers as vf
from datasets import Dataset


def multiply(a: int, b: int) -> int:
    """The product of a and b."""
    return a * b


def row(rng: random.Random, skip_prob: float) -> dict:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "multiply", "arguments": json.dumps({"a": a, "b": b})},
    }
    if rng.random() < skip_prob:
        guess = a * b + rng.choice((-1, 1)) * rng.randint(1, 9)
        demo = [{"role": "assistant", "content": str(abs(guess)), "tool_calls": None, "tool_call_id": None}]
    else:
        demo = [
            {"role": "assistant", "content": "", "tool_calls": [call], "tool_call_id": None},
            {"role": "tool", "content": str(a * b), "tool_calls": None, "tool_call_id": "call_0"},
            {"role": "assistant", "content": str(a * b), "tool_calls": None, "tool_call_id": None},
        ]
    return {"question": f"What is {a} times {b}?", "answer": str(a * b), "demo": demo}


def correct(completion, answer, **kwargs) -> float:
    """1 when the last reply is the product, else 0."""
    last = completion[-1] if completion else {}
    text = last.get("content") if isinstance(last, dict) else getattr(last, "content", "")
    return 1.0 if isinstance(text, str) and text.strip() == answer else 0.0


def load_environment(
    rows: int = 2000, eval_rows: int = 64, skip_prob: float = 0.5, seed: int = 0, max_turns: int = 3
) -> vf.Environment:
    rng = random.Random(seed)
    train = Dataset.from_list([row(rng, skip_prob) for _ in range(rows)])
    held_out = Dataset.from_list([row(rng, 0.0) for _ in range(eval_rows)])
    return vf.ToolEnv(
        dataset=train, eval_dataset=held_out, tools=[multiply], rubric=vf.Rubric(funcs=[correct]), max_turns=max_turns
    )
