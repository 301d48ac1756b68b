"""Seeded synthetic responses: long-tailed lengths, token ids and logprobs.

RL response lengths are long-tailed: most responses are short, a few run to the length cap (the
tail that RollPacker's tail batching and ROLL-Flash's asynchrony exist for). A lognormal with a
cap reproduces that shape with two knobs: the median and ``sigma`` (sigma 1 puts ~16% of responses
above 2.7 × the median). Everything is drawn from one ``random.Random`` per request, seeded by the
request's seed, so a response does not depend on its batch mates or on when it ran.
"""

from __future__ import annotations

import math
import random


def response_length(rng: random.Random, median: float, sigma: float, cap: int) -> int:
    """Tokens of one response: ``lognormal(ln median, sigma)`` rounded up, in ``[1, cap]``."""
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    draw = rng.lognormvariate(math.log(max(median, 1e-9)), sigma) if sigma > 0 else median
    return max(1, min(cap, math.ceil(draw)))


def next_token(rng: random.Random, vocab_size: int, avoid: frozenset[int]) -> tuple[int, float]:
    """A token id below ``vocab_size`` outside ``avoid`` (the stop tokens) and a finite logprob < 0."""
    token = rng.randrange(vocab_size)
    while token in avoid and len(avoid) < vocab_size:
        token = (token + 1) % vocab_size
    return token, -min(20.0, 1e-3 + rng.expovariate(2.0))


def lognormal_mean(median: float, sigma: float) -> float:
    """The uncapped lognormal's mean, ``median · exp(sigma² / 2)`` (for sizing runs by hand)."""
    return median * math.exp(sigma * sigma / 2.0)
