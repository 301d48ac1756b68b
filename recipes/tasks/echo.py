"""``echo``: copy a word out of a fixed-width field; the warm start sometimes slips a letter.

Example (``width = 12``; the default is 32)::

    prompt    qdkx........:
    response  qdkx

The prompt is a word of ``n`` random lowercase letters, left-aligned in a field of ``width``
characters padded with ``.``, then ``:``. The correct response is the word. The reward is
verifiable: 1.0 when the response (stripped) equals the word, else 0.0.

Why this task suits the default recipe (the README's one-command run):

- **A tiny transformer learns it in a few hundred SFT steps, reliably.** Because the field has a
  fixed width, the letter to write next always sits at the same distance back (``width + 1``
  tokens): one relative-position attention head (RoPE makes that easy) copies it, and the stop
  decision is local (the copied character is ``.``: write ``<eos>``). Measured on 2 cores: >90 %
  greedy exact-match after ~100 clean steps. Two designs we measured and rejected: copying a
  variable-length prompt needs an induction head ("find the letter I just wrote, copy the next"),
  which at this scale forms only after ~1000 steps, later still with noisy demonstrations; and
  running sums modulo 10 give no first-order signal to attend to either operand, so they are
  learned slowly (``chainsum``).
- **Response lengths with a long tail.** ``n`` is geometric with mean ``mean_len``, clipped at
  ``width``: most responses are 2-8 tokens, one in ten is over ~14, the longest reach
  ``width + 1`` (with ``<eos>``) — stragglers that make a synchronous step wait.
- **RL has real room after the warm start.** SFT demonstrations carry *structured* noise: each
  letter, with probability ``slip_prob``, is replaced by the next letter of the alphabet (``q``
  becomes ``r``; ``z`` becomes ``a``). The slip keeps the response aligned with the field, so the
  copy mechanism stays exact and the policy learns the slip *rate*: sampled at temperature 1.0 it
  solves an ``n``-letter word with probability ~``(1 - slip_prob)^n``, about 1/3 held-out
  accuracy at the defaults, long words failing most. The mistake is one consistent direction
  ("write the successor") that a reward signal finds and suppresses: GRPO lifts held-out sampled
  accuracy by 40+ points in about a minute of CPU.

Train and eval items come from separate seeded streams; words of three or more letters
(17 576+ of them) rarely coincide across the splits.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from flash.tasks import Task, TaskItem, register_task

LETTERS = string.ascii_lowercase
PAD_CHAR = "."


@dataclass(frozen=True)
class EchoOptions:
    """Options of ``echo`` (the keys a recipe's ``task:`` block accepts)."""

    seed: int = 0
    width: int = 32  # field width = longest word; the response is at most width + 1 tokens
    mean_len: float = 6.0  # mean of the geometric word length (before clipping at width)
    slip_prob: float = 0.25  # per-letter probability of a successor-letter slip in SFT data
    eval_size: int = 256  # held-out items used by eval_items()

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"width must be >= 1, got {self.width}")
        if not 1.0 <= self.mean_len <= self.width:
            raise ValueError(f"mean_len must be in [1, width], got {self.mean_len}")
        if not 0.0 <= self.slip_prob < 1.0:
            raise ValueError(f"slip_prob must be in [0, 1), got {self.slip_prob}")
        if self.eval_size < 1:
            raise ValueError(f"eval_size must be >= 1, got {self.eval_size}")


def geometric_length(rng: random.Random, mean: float, cap: int) -> int:
    """Length >= 1, geometric with the given mean, clipped at ``cap`` (the long tail)."""
    n = 1
    while n < cap and rng.random() >= 1.0 / mean:
        n += 1
    return n


def slip(word: str, rng: random.Random, prob: float) -> str:
    """``word`` with each letter replaced by its alphabet successor with probability ``prob``."""
    return "".join(LETTERS[(LETTERS.index(c) + 1) % 26] if rng.random() < prob else c for c in word)


@register_task("echo")
class Echo(Task):
    """Copy a word out of a fixed-width field (see the module docstring for the design)."""

    Options = EchoOptions

    def _make_item(self, index: int, split: str, rng: random.Random) -> TaskItem:
        o = self.options
        n = geometric_length(rng, o.mean_len, o.width)
        word = "".join(rng.choice(LETTERS) for _ in range(n))
        prompt = word + PAD_CHAR * (o.width - n) + ":"
        return TaskItem(index=index, prompt=prompt, answer=word, meta={"length": n, "split": split})

    def max_response_tokens(self) -> int:
        return self.options.width + 1  # the word, then <eos>

    def reward(self, item: TaskItem, response: str) -> float:
        return 1.0 if response.strip() == item.answer else 0.0

    def sft_pair(self, index: int) -> tuple[str, str]:
        """Train item ``index`` with a demonstration that slips each letter to its successor
        with probability ``slip_prob`` (seeded by its own stream)."""
        item = self.item(index, "train")
        rng = self.rng(index, "train", stream="slip")
        return item.prompt, slip(item.answer, rng, self.options.slip_prob)
