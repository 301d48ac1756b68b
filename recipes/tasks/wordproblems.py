"""``wordproblems``: arithmetic word problems with checkable answers, generated offline from a seed.

Example::

    prompt    tom has 3 apples and buys 4 more. how many apples now?
    response  3+4=7

Each item is one of three kinds of story: getting more (``+``: buys, finds, gets, wins), giving
some away (``-``: eats, loses, sells, gives away; never below zero) and equal groups (``*``: bags
with ``b`` things each). Operands are ``1 .. max_operand``. The response writes the equation and
its value; the reward is the ``math`` reward (math-verify), so ``3+4=7``, ``7`` and
``the answer is 7`` all score 1.0 and ``3+4=8`` scores 0.0. math-verify compares values, so an
unfinished ``3+4`` also counts: it equals 7. Prompts are lower case, digits and ``.?:`` (the tiny
tokenizer's first, stable ids); a pretrained model reads them too.

How it differs from ``chainsum`` (the other arithmetic task): chainsum is a symbolic running sum
modulo 10 over lettered digits with a geometric length tail, graded by exact match on the last
digit; here the operation must be read from the words (the verb picks ``+``, ``-`` or ``*``), the
answer is an ordinary integer (0 .. ``max_operand``²) and the grader is math-verify. Both share the
warm-start design below.

Why RL has room after the warm start: SFT demonstrations carry *structured* noise. With
probability ``slip_prob`` the demonstrated value is one too high (``3+4=8``): the chain is right,
the result is off by one in one consistent direction. A warm start learns the format, the verb →
operator mapping and the tables, and reproduces the slip rate when sampled (about
``1 - slip_prob`` held-out accuracy at temperature 1.0, less where the tables are not yet
learnt); a reward signal finds the one direction that fails and suppresses it.

Measured (``flash run math``, 2 shared cores, BENCHMARKS.md): the warm start (400 SFT steps) is at
~0.73-0.77 sampled held-out accuracy; 60 GRPO steps take it to 0.91. Harder settings (``ops:
"+-*"``, operands to 9) are there, but a clean SFT of 400 steps reached only 24 % greedy accuracy on
them: the tiny model learns the larger tables slowly, so the defaults are ``+-`` and operands <= 5.

Train and eval items come from separate seeded streams. The space of problems is small (names ×
things × verbs × operands: ~16 000 prompts but only 40 distinct equations at the defaults), so the
held-out set shares equations with training: it measures the skill on unseen wordings, not on
unseen sums.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from flash.tasks import Task, TaskItem, register_task

NAMES = ("tom", "ann", "sam", "mia", "leo", "eva", "max", "zoe", "ben", "ida")
THINGS = ("apple", "pear", "coin", "book", "card", "egg", "shell", "stamp", "ball", "cake")
MORE_VERBS = ("buys", "finds", "gets", "wins")
LESS_VERBS = ("eats", "loses", "sells", "gives away")
OPS = ("+", "-", "*")


@dataclass(frozen=True)
class WordProblemsOptions:
    """Options of ``wordproblems`` (the keys a recipe's ``task:`` block accepts)."""

    seed: int = 0
    max_operand: int = 5  # operands are drawn from 1 .. max_operand
    ops: str = "+-"  # which kinds of story to draw (a subset of '+-*')
    slip_prob: float = 0.2  # probability that an SFT demonstration's value is one too high
    eval_size: int = 256  # held-out items used by eval_items()

    def __post_init__(self) -> None:
        if not 2 <= self.max_operand <= 99:
            raise ValueError(f"max_operand must be in [2, 99], got {self.max_operand}")
        if not self.ops or any(op not in OPS for op in self.ops):
            raise ValueError(f"ops must be a non-empty subset of '+-*', got {self.ops!r}")
        if not 0.0 <= self.slip_prob < 1.0:
            raise ValueError(f"slip_prob must be in [0, 1), got {self.slip_prob}")
        if self.eval_size < 1:
            raise ValueError(f"eval_size must be >= 1, got {self.eval_size}")


def story(op: str, a: int, b: int, name: str, thing: str, rng: random.Random) -> str:
    """The word problem for ``a op b`` (lower case)."""
    if op == "+":
        return f"{name} has {a} {thing}s and {rng.choice(MORE_VERBS)} {b} more. how many {thing}s now?"
    if op == "-":
        return f"{name} has {a} {thing}s and {rng.choice(LESS_VERBS)} {b}. how many {thing}s now?"
    return f"{name} has {a} bags with {b} {thing}s each. how many {thing}s in all?"


def evaluate(op: str, a: int, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def equation(op: str, a: int, b: int, value: int) -> str:
    return f"{a}{op}{b}={value}"


@register_task("wordproblems")
class WordProblems(Task):
    """Arithmetic word problems (see the module docstring for the design)."""

    Options = WordProblemsOptions

    def _make_item(self, index: int, split: str, rng: random.Random) -> TaskItem:
        o = self.options
        op = rng.choice(o.ops)
        a, b = rng.randint(1, o.max_operand), rng.randint(1, o.max_operand)
        if op == "-" and b > a:
            a, b = b, a  # never below zero
        name, thing = rng.choice(NAMES), rng.choice(THINGS)
        value = evaluate(op, a, b)
        meta = {"op": op, "a": a, "b": b, "solution": equation(op, a, b, value), "split": split}
        return TaskItem(index=index, prompt=story(op, a, b, name, thing, rng), answer=str(value), meta=meta)

    def max_response_tokens(self) -> int:
        digits = len(str(self.options.max_operand))
        return 2 * digits + 2 + 2 * digits + 1  # "a*b=" + value + <eos>

    def reward(self, item: TaskItem, response: str) -> float:
        """The ``math`` reward (math-verify), so the task and ``reward.fn: math`` agree."""
        from flash.rewards.builtin import math_reward

        return math_reward(item, response)

    def sft_pair(self, index: int) -> tuple[str, str]:
        """Train item ``index`` with a demonstration whose value is one too high with
        probability ``slip_prob`` (its own seeded stream)."""
        item = self.item(index, "train")
        rng = self.rng(index, "train", stream="slip")
        m = item.meta
        value = int(item.answer) + (1 if rng.random() < self.options.slip_prob else 0)
        return item.prompt, equation(m["op"], m["a"], m["b"], value)
