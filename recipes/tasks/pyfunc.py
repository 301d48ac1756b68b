"""``pyfunc``: write a one-line Python function from a spec, graded by hidden tests in the sandbox.

Example (two operations)::

    prompt    add 2 mul 3:
    response  def f(x): return (x+2)*3

The spec is a chain of operations applied to ``x`` in order (``add c``, ``sub c``, ``mul c``,
``mod c``, single-digit constants); the response must define ``f`` computing it. The reward runs
the response in the code sandbox (``flash.rewards.sandbox``) on hidden inputs and compares with
outputs computed here by applying the chain step by step (never by evaluating a string), so only
code that behaves right passes: ``x+2*3`` is valid Python, returns for every input, and fails.
The hidden tests sit in ``item.meta`` in the form the ``code`` reward reads (``entry_point: f``,
``tests: [{input: [x], output: y}]``, ``family``: the number of operations, which keys the
adaptive sandbox timeout).

The skill and what RL has left to learn: Python's precedence. A chain that applies a
multiplicative operation (``mul``, ``mod``) after an additive one (``add``, ``sub``) needs the
expression so far in parentheses: ``add 2 mul 3`` is ``(x+2)*3``. The SFT demonstrations drop
those parentheses with probability ``paren_slip`` (the classic precedence bug: the code still runs
and is wrong), so the warm start learns the format, the word-to-operator mapping and the digits,
but parenthesises at about the demonstrated rate. ``paren_share`` of the items are drawn so that
they need parentheses; at the defaults (0.9, 0.75) the sampled warm start passes ~0.1 + 0.9 x 0.25
~ 1/3 of held-out items. The mistake is one decision at one token (``(`` after ``return``, or not),
so GRPO finds it; the held-out pass rate rises within a few dozen steps.

``reward(item, response)`` (used by the SFT stage's held-out check and when a recipe sets no
``reward.fn``) runs the same sandbox with pass/fail scoring. Held-out specs are never trained on:
the space of two-step specs is small (~1k), so instead of trusting separate random streams, a spec
belongs to the eval split iff a hash of its text falls in one eighth of the range (``EVAL_SHARD``),
and each split redraws until its spec is its own.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from functools import lru_cache

from flash.tasks import Task, TaskItem, register_task

# name -> (operator, multiplicative?, smallest constant)
OPS: dict[str, tuple[str, bool, int]] = {
    "add": ("+", False, 1),
    "sub": ("-", False, 1),
    "mul": ("*", True, 2),
    "mod": ("%", True, 2),
}
ADDITIVE = [n for n, (_, mult, _) in OPS.items() if not mult]
MULTIPLICATIVE = [n for n, (_, mult, _) in OPS.items() if mult]
HEADER = "def f(x): return "
EVAL_SHARD = 8  # one spec in EVAL_SHARD (by hash) is held out for the eval split
TEST_INPUTS = range(-9, 30)  # hidden tests call f on distinct inputs drawn from here


@dataclass(frozen=True)
class PyFuncOptions:
    """Options of ``pyfunc`` (the keys a recipe's ``task:`` block accepts)."""

    seed: int = 0
    min_ops: int = 2
    max_ops: int = 3
    paren_share: float = 0.9  # share of items drawn so that they need parentheses
    paren_slip: float = 0.75  # probability an SFT demonstration drops needed parentheses
    num_tests: int = 6  # hidden tests per item
    eval_size: int = 128  # held-out items used by eval_items()

    def __post_init__(self) -> None:
        if not 1 <= self.min_ops <= self.max_ops <= 6:
            raise ValueError(f"need 1 <= min_ops <= max_ops <= 6, got {self.min_ops}, {self.max_ops}")
        if not 0.0 <= self.paren_share <= 1.0:
            raise ValueError(f"paren_share must be in [0, 1], got {self.paren_share}")
        if self.paren_share > 0 and self.max_ops < 2:
            raise ValueError("paren_share > 0 needs max_ops >= 2 (parentheses need two operations)")
        if not 0.0 <= self.paren_slip < 1.0:
            raise ValueError(f"paren_slip must be in [0, 1), got {self.paren_slip}")
        if not 1 <= self.num_tests <= len(TEST_INPUTS):
            raise ValueError(f"num_tests must be in [1, {len(TEST_INPUTS)}], got {self.num_tests}")
        if self.eval_size < 1:
            raise ValueError(f"eval_size must be >= 1, got {self.eval_size}")


def apply_chain(chain: list[tuple[str, int]], x: int) -> int:
    """The reference semantics: each operation applied to the running value, in order."""
    for name, c in chain:
        x = x + c if name == "add" else x - c if name == "sub" else x * c if name == "mul" else x % c
    return x


def needs_parens(chain: list[tuple[str, int]]) -> bool:
    """True when some multiplicative operation follows an additive one."""
    seen_additive = False
    for name, _ in chain:
        if OPS[name][1] and seen_additive:
            return True
        seen_additive = seen_additive or not OPS[name][1]
    return False


def expression(chain: list[tuple[str, int]], parens: bool = True) -> str:
    """Python for the chain over ``x``. ``parens=False`` writes the precedence bug: the running
    expression is never wrapped, so ``add 2 mul 3`` becomes ``x+2*3``."""
    expr, top_additive = "x", False
    for name, c in chain:
        op, mult, _ = OPS[name]
        if parens and mult and top_additive:
            expr = f"({expr})"
        expr, top_additive = f"{expr}{op}{c}", not mult
    return expr


def spec_text(chain: list[tuple[str, int]]) -> str:
    return " ".join(f"{name} {c}" for name, c in chain) + ":"


def spec_split(chain: list[tuple[str, int]]) -> str:
    """The split a spec belongs to: 'eval' for one spec in ``EVAL_SHARD`` by hash, else 'train'."""
    digest = hashlib.sha256(spec_text(chain).encode()).digest()
    return "eval" if digest[0] % EVAL_SHARD == 0 else "train"


def _draw_chain(rng: random.Random, k: int, want_parens: bool, split: str) -> list[tuple[str, int]]:
    """``k`` random operations of ``split``'s specs; with ``want_parens`` an additive one is
    followed (somewhere later) by a multiplicative one. Redrawing keeps the draw uniform over the
    specs that qualify."""
    while True:
        names = [rng.choice(list(OPS)) for _ in range(k)]
        chain = [(n, rng.randint(OPS[n][2], 9)) for n in names]
        if (not want_parens or needs_parens(chain)) and spec_split(chain) == split:
            return chain


@lru_cache(maxsize=1)
def _pass_fail_scorer():
    from flash.rewards.builtin import CodeReward

    return CodeReward(all_or_nothing=True)


@register_task("pyfunc")
class PyFuncTask(Task):
    """Write ``f(x)`` for a chain of operations (see the module docstring for the design)."""

    Options = PyFuncOptions

    def _make_item(self, index: int, split: str, rng: random.Random) -> TaskItem:
        o = self.options
        want_parens = rng.random() < o.paren_share
        k = rng.randint(max(o.min_ops, 2) if want_parens else o.min_ops, o.max_ops)
        chain = _draw_chain(rng, k, want_parens, split)
        xs = rng.sample(TEST_INPUTS, o.num_tests)
        tests = [{"input": [x], "output": apply_chain(chain, x)} for x in xs]
        solution = HEADER + expression(chain)
        meta = {
            "entry_point": "f",
            "tests": tests,
            "family": f"ops{k}",
            "chain": [list(s) for s in chain],
            "needs_parens": needs_parens(chain),
            "solution": solution,
            "split": split,
        }
        return TaskItem(index=index, prompt=spec_text(chain), answer=solution, meta=meta)

    def max_response_tokens(self) -> int:
        # header, "x", per op at most "(" + ")" + operator + digit, then <eos>
        return len(HEADER) + 1 + 4 * self.options.max_ops + 1

    def reward(self, item: TaskItem, response: str) -> float:
        """1.0 when the response passes every hidden test in the sandbox, else 0.0."""
        return _pass_fail_scorer()(item, response)

    def sft_pair(self, index: int) -> tuple[str, str]:
        """Train item ``index`` with a demonstration that, when the chain needs parentheses, drops
        them with probability ``paren_slip`` (its own seeded stream)."""
        item = self.item(index, "train")
        chain = [tuple(s) for s in item.meta["chain"]]
        slip = item.meta["needs_parens"] and self.rng(index, "train", "slip").random() < self.options.paren_slip
        return item.prompt, HEADER + expression(chain, parens=not slip)
