"""``stutter``: copy a string of distinct letters; the warm start sometimes stutters.

Example::

    prompt    qdkx:
    response  qdkx

The prompt is ``n`` distinct lowercase letters and ``:``; the correct response repeats them
exactly. The reward is verifiable: 1.0 when the response equals the string, else 0.0.

Why this task is the default:

- **A tiny transformer learns it in well under a minute.** Copying distinct tokens is what an
  induction head does ("find the letter I just wrote in the prompt, write the one after it"),
  among the first circuits small transformers form; there is no arithmetic to memorise.
- **Response lengths with a long tail.** ``n`` is geometric with mean ``mean_len`` (clipped to
  ``max_len``): most responses are 2-8 tokens, one in ten is over ~12 and the longest reach
  ~25 — the stragglers that make a synchronous step wait and that async rollout overlaps.
- **RL has real room after the warm start.** SFT demonstrations carry *structured* noise: after
  each letter, with probability ``slip_prob``, the letter is written twice (the copy then goes
  on correctly). Cross-entropy teaches the policy to stutter at that rate, so sampled at
  temperature 1.0 it solves an ``n``-letter item with probability about ``(1 - slip_prob)^n``:
  ~30 % held-out accuracy at the defaults, long items failing most. The mistake is one
  consistent direction in the policy (repeat the last letter), which a reward signal finds and
  suppresses: ~100 GRPO steps on a laptop CPU add 25+ points.

Train and eval items come from separate seeded streams (the task base class hashes the split
into the seed); for ``n >= 3`` the space of strings is large enough that they rarely overlap.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from flash.tasks import Task, TaskItem, register_task

LETTERS = string.ascii_lowercase


@dataclass(frozen=True)
class StutterOptions:
    """Options of ``stutter`` (the keys a recipe's ``task:`` block accepts)."""

    seed: int = 0
    mean_len: float = 5.0  # mean of the geometric draw of the string length (before clipping)
    max_len: int = 24  # <= 26: letters in a string are distinct
    slip_prob: float = 0.15  # per-letter probability of a doubled letter in SFT demonstrations
    eval_size: int = 256  # held-out items used by eval_items()

    def __post_init__(self) -> None:
        if not 1 <= self.max_len <= len(LETTERS):
            raise ValueError(f"max_len must be in [1, {len(LETTERS)}], got {self.max_len}")
        if self.mean_len < 1:
            raise ValueError(f"mean_len must be >= 1, got {self.mean_len}")
        if not 0.0 <= self.slip_prob < 1.0:
            raise ValueError(f"slip_prob must be in [0, 1), got {self.slip_prob}")
        if self.eval_size < 1:
            raise ValueError(f"eval_size must be >= 1, got {self.eval_size}")


def draw_length(rng: random.Random, mean: float, cap: int) -> int:
    """Geometric length >= 1 with the given mean, clipped at ``cap`` (the long tail)."""
    n = 1
    while n < cap and rng.random() > 1.0 / mean:
        n += 1
    return n


def stutter(text: str, rng: random.Random, slip_prob: float) -> str:
    """``text`` with each character doubled with probability ``slip_prob``."""
    return "".join(ch + ch if rng.random() < slip_prob else ch for ch in text)


@register_task("stutter")
class StutterTask(Task):
    Options = StutterOptions

    def _make_item(self, index: int, split: str, rng: random.Random) -> TaskItem:
        n = draw_length(rng, self.options.mean_len, self.options.max_len)
        text = "".join(rng.sample(LETTERS, n))
        return TaskItem(index=index, prompt=f"{text}:", answer=text, meta={"length": n, "split": split})

    def reward(self, item: TaskItem, response: str) -> float:
        return 1.0 if response.strip() == item.answer else 0.0

    def sft_pair(self, index: int) -> tuple[str, str]:
        item = self.item(index, "train")
        rng = self.rng(index, "train", stream="slip")
        return item.prompt, stutter(item.answer, rng, self.options.slip_prob)

    def max_response_tokens(self) -> int:
        return 2 * self.options.max_len + 1
