"""Seeded synthetic responses: long-tailed lengths, token ids and logprobs.

RL response lengths are long-tailed: most responses are short, a few run to the length cap (the
tail that RollPacker's tail batching and ROLL-Flash's asynchrony exist for). A lognormal with a
cap reproduces that shape with two knobs: the median and ``sigma`` (sigma 1 puts ~16% of responses
above 2.7 × the median). Everything is drawn from one ``random.Random`` per request, seeded by the
request's seed, so a response does not depend on its batch mates or on when it ran.

Lengths are also correlated within a prompt (a hard prompt is long for all its samples: what
tail batching's group rule relies on): ``prompt_factor`` scales a prompt's median by
``exp(prompt_sigma · z)``, ``z`` drawn from the prompt's token ids, so every sample of a prompt,
and the same prompt run again, shares it.
"""

from __future__ import annotations

import math
import random
import zlib


def response_length(rng: random.Random, median: float, sigma: float, cap: int) -> int:
    """Tokens of one response: ``lognormal(ln median, sigma)`` rounded up, in ``[1, cap]``."""
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    draw = rng.lognormvariate(math.log(max(median, 1e-9)), sigma) if sigma > 0 else median
    return max(1, min(cap, math.ceil(draw)))


def prompt_factor(prompt_ids: list[int], prompt_sigma: float) -> float:
    """``exp(prompt_sigma · z)``, ``z`` standard normal seeded by the prompt's ids (1.0 at sigma 0)."""
    if prompt_sigma <= 0:
        return 1.0
    z = random.Random(zlib.crc32(",".join(map(str, prompt_ids)).encode())).gauss(0.0, 1.0)
    return math.exp(prompt_sigma * z)


def next_token(rng: random.Random, vocab_size: int, avoid: frozenset[int]) -> tuple[int, float]:
    """A token id below ``vocab_size`` outside ``avoid`` (the stop tokens) and a finite logprob < 0."""
    token = rng.randrange(vocab_size)
    while token in avoid and len(avoid) < vocab_size:
        token = (token + 1) % vocab_size
    return token, -min(20.0, 1e-3 + rng.expovariate(2.0))


def lognormal_mean(median: float, sigma: float) -> float:
    """The uncapped lognormal's mean, ``median · exp(sigma² / 2)`` (for sizing runs by hand)."""
    return median * math.exp(sigma * sigma / 2.0)
