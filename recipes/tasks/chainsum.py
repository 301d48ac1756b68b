"""``chainsum``: a running sum of lettered digits modulo 10 (a harder arithmetic task).

Example (``n = 4`` terms)::

    prompt    a3 b5 c2 d8:
    response  a3 b8 c0 d8 =8

The prompt lists ``n`` digits tagged with the letters ``a, b, c, ...``. The response walks the
letters in order and writes, after each letter, the running sum of the digits so far modulo 10,
then ``=`` and the final sum (the answer). The reward is verifiable: 1.0 when the text after the
response's last ``=`` is the right digit, else 0.0 (answer-only, as in math RLVR; a wrong chain
that ends on the right digit by luck still scores, about 1 time in 10).

What it is for: an arithmetic task with a long tail of response lengths (``n`` is geometric with
mean ``mean_terms``, resampled into ``[min_terms, max_terms]``; a response has ``3n + 2``
characters plus ``<eos>``: median ~12 tokens, p90 ~30, max ~51) and structured SFT noise (at each
step, with probability ``slip_prob``, the demonstrated running sum is one too high and the chain
carries on from the wrong value), so a sampled warm start solves an ``n``-term item with
probability ~``(1 - slip_prob)^n``.

Why it does not suit the default recipe (measured on 2 CPU cores, hidden 128, 4 layers): a tiny
transformer learns it slowly. Each sum needs two operands (the digit after the current letter in
the prompt, found by an induction-style lookup, and the previous sum), and modulo-10 addition
gives no first-order signal for attending to either operand alone: after 900 clean SFT steps
greedy accuracy was ~35 %. The warm start then fails for lack of skill rather than by the
structured slip, which RL fixes slowly. ``echo`` suits the default recipe; this task stays as a
harder one.

Train and eval items come from separate seeded streams; the prompt space is large for ``n >= 3``
(``10^n`` digit strings), so overlap between the splits is confined to the shortest items.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from flash.tasks import Task, TaskItem, register_task

LETTERS = string.ascii_lowercase


@dataclass(frozen=True)
class ChainSumOptions:
    """Options of ``chainsum`` (names are the keys a recipe's ``task:`` block accepts)."""

    seed: int = 0
    min_terms: int = 1
    max_terms: int = 16  # <= 26 letters; response length is 3 * terms + 3 tokens with <eos>
    mean_terms: float = 4.5  # mean of the geometric draw of the number of terms (before clipping)
    slip_prob: float = 0.2  # per-step probability of an off-by-one slip in SFT demonstrations
    eval_size: int = 256  # held-out items used by eval_items()

    def __post_init__(self) -> None:
        if not 1 <= self.min_terms <= self.max_terms <= len(LETTERS):
            raise ValueError(f"need 1 <= min_terms <= max_terms <= {len(LETTERS)}")
        if self.mean_terms < self.min_terms:
            raise ValueError("mean_terms must be >= min_terms")
        if not 0.0 <= self.slip_prob < 1.0:
            raise ValueError("slip_prob must be in [0, 1)")
        if self.eval_size < 1:
            raise ValueError("eval_size must be >= 1")


def running_sums(digits: list[int], slips: list[bool] | None = None) -> list[int]:
    """Running sums modulo 10; where ``slips[i]`` is true, step ``i`` adds one extra."""
    sums, total = [], 0
    for i, d in enumerate(digits):
        total = (total + d + (1 if slips and slips[i] else 0)) % 10
        sums.append(total)
    return sums


def format_prompt(digits: list[int]) -> str:
    return " ".join(f"{LETTERS[i]}{d}" for i, d in enumerate(digits)) + ":"


def format_response(sums: list[int]) -> str:
    return " ".join(f"{LETTERS[i]}{s}" for i, s in enumerate(sums)) + f" ={sums[-1]}"


def parse_answer(response: str) -> str | None:
    """The text after the last ``=``, stripped; None when there is no ``=``."""
    if "=" not in response:
        return None
    return response.rsplit("=", 1)[1].strip()


@register_task("chainsum")
class ChainSum(Task):
    """Running sum of lettered digits modulo 10 (see the module docstring for the design)."""

    Options = ChainSumOptions

    def _num_terms(self, rng: random.Random) -> int:
        """Geometric on ``min_terms, min_terms + 1, ...`` with mean ``mean_terms``, redrawn
        until it is <= ``max_terms`` (a truncated geometric keeps the tail's shape)."""
        o = self.options
        extra_mean = o.mean_terms - o.min_terms
        q = 1.0 / (1.0 + extra_mean)  # success probability of the geometric on {0, 1, ...}
        while True:
            n = o.min_terms
            while rng.random() >= q:
                n += 1
            if n <= o.max_terms:
                return n

    def _make_item(self, index: int, split: str, rng: random.Random) -> TaskItem:
        n = self._num_terms(rng)
        digits = [rng.randrange(10) for _ in range(n)]
        sums = running_sums(digits)
        solution = format_response(sums)
        meta = {"digits": digits, "terms": n, "solution": solution, "split": split}
        return TaskItem(index=index, prompt=format_prompt(digits), answer=str(sums[-1]), meta=meta)

    def max_response_tokens(self) -> int:
        return 3 * self.options.max_terms + 3  # "a3 " per term, "=7", <eos>

    def solution(self, item: TaskItem) -> str:
        """The clean (noise-free) response for ``item``."""
        return item.meta["solution"]

    def reward(self, item: TaskItem, response: str) -> float:
        return 1.0 if parse_answer(response) == item.answer else 0.0

    def sft_pair(self, index: int) -> tuple[str, str]:
        """Train item ``index`` with a demonstration that slips (``+1``) at each step with
        probability ``slip_prob``; the slips come from their own seeded stream."""
        item = self.item(index, "train")
        rng = self.rng(index, "train", stream="sft")
        slips = [rng.random() < self.options.slip_prob for _ in item.meta["digits"]]
        return item.prompt, format_response(running_sums(item.meta["digits"], slips))
