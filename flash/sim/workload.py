"""Seeded synthetic responses: long-tailed lengths, token ids and logprobs.

RL response lengths are long-tailed: most responses are short, a few run to the length cap (the
tail that RollPacker's tail batching and ROLL-Flash's asynchrony exist for). A lognormal with a
cap reproduces that shape with two knobs: the median and ``sigma`` (sigma 1 puts ~16% of responses
above 2.7 × the median). A response's length is drawn from one ``random.Random`` per request,
seeded by the request's seed, and its token ids and logprobs are a hash of (seed, position)
(``draw_tokens``: every running response's next ids in a few array operations), so a response
does not depend on its batch mates or on when it ran.

Or lengths come from a real run (``sim.lengths``: its ``ledger.jsonl``, or a file of integers):
each prompt draws one observed group (a prompt's samples in one step) and each of its samples one
length of it, so a simulation at scale sees the distribution a small real run produced, its
correlation within a prompt included (a task whose lengths are not lognormal: copies, formats).

Lengths are also correlated within a prompt (a hard prompt is long for all its samples: what
tail batching's group rule relies on): ``prompt_factor`` scales a prompt's median by
``exp(prompt_sigma · z)``, ``z`` drawn from the prompt's token ids, so every sample of a prompt,
and the same prompt run again, shares it.
"""

from __future__ import annotations

import json
import math
import random
import zlib
from pathlib import Path

import numpy as np

MAX_LENGTHS = 1_000_000  # observed lengths read from one file (a sample of them draws the same)
MAX_LENGTH_FILE_BYTES = 512 << 20


def response_length(rng: random.Random, median: float, sigma: float, cap: int) -> int:
    """Tokens of one response: ``lognormal(ln median, sigma)`` rounded up, in ``[1, cap]``."""
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    draw = rng.lognormvariate(math.log(max(median, 1e-9)), sigma) if sigma > 0 else median
    return max(1, min(cap, math.ceil(draw)))


def prompt_rng(prompt_ids: list[int]) -> random.Random:
    """A generator seeded by a prompt's token ids alone: what every sample of the prompt, and the
    prompt run again, draws alike (its length factor, its observed group)."""
    return random.Random(zlib.crc32(",".join(map(str, prompt_ids)).encode()))


def observed_length(
    rng: random.Random, groups: tuple[tuple[int, ...], ...], prompt_ids: list[int], factor: float, cap: int
) -> int:
    """One observed length times ``factor``, rounded up, in ``[1, cap]``: the prompt's ids pick one
    observed group (every sample of a prompt the same one: lengths stay correlated within a prompt,
    as in the run they came from), ``rng`` one of its lengths."""
    group = groups[prompt_rng(prompt_ids).randrange(len(groups))]
    return max(1, min(cap, math.ceil(rng.choice(group) * factor)))


def _parse_line(path: Path, number: int, line: str) -> tuple[tuple | None, list[int]]:
    """(the group key of a ledger line, or None for a plain list or integer; its lengths)."""
    try:
        value = json.loads(line)
    except ValueError:
        raise ValueError(f"sim.lengths: {path} line {number} is neither JSON nor an integer") from None
    key = None
    values = value if isinstance(value, list) else [value]
    if isinstance(value, dict):  # a ledger line: trained samples only, grouped by step and prompt
        values = [value.get("len")] if value.get("outcome") == "trained" else []
        key = (value.get("step"), value.get("prompt_id"))
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"sim.lengths: {path} line {number} has {v!r} where a length (an integer >= 0) belongs")
    return key, values


def _groups_in(path: Path, lines) -> list[list[int]]:
    """A ledger's lengths grouped by (step, prompt); a list of integers' each a group of its own."""
    groups: dict[object, list[int]] = {}
    count = 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        key, values = _parse_line(path, number, line)
        for v in values:
            groups.setdefault(key if key is not None else count, []).append(max(1, v))
            count += 1
        if count >= MAX_LENGTHS:
            break
    return list(groups.values())


def load_lengths(path: str) -> tuple[tuple[int, ...], ...]:
    """Observed response lengths from ``path``, in groups: a run dir or its ``ledger.jsonl`` (every
    trained sample's ``len``, one group per step and prompt), a JSON list or one integer per line
    (each its own group). Data only: parsed as JSON, bounded in bytes and count; ValueError with
    one line naming the file (and line) otherwise."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "ledger.jsonl"
    if not p.is_file():
        raise ValueError(f"sim.lengths: no file {p} (give a run dir, its ledger.jsonl or a file of integers)")
    if p.stat().st_size > MAX_LENGTH_FILE_BYTES:
        raise ValueError(f"sim.lengths: {p} is over {MAX_LENGTH_FILE_BYTES >> 20} MiB; pass a sample of its lengths")
    with p.open(encoding="utf-8", errors="replace") as f:
        groups = _groups_in(p, f)
    if not groups:
        raise ValueError(f"sim.lengths: {p} holds no response length (a ledger without trained samples?)")
    return tuple(tuple(g) for g in groups)


def prompt_factor(prompt_ids: list[int], prompt_sigma: float) -> float:
    """``exp(prompt_sigma · z)``, ``z`` standard normal seeded by the prompt's ids (1.0 at sigma 0)."""
    if prompt_sigma <= 0:
        return 1.0
    z = prompt_rng(prompt_ids).gauss(0.0, 1.0)
    return math.exp(prompt_sigma * z)


def draw_tokens(seeds: np.ndarray, starts: np.ndarray, k: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids below ``vocab_size`` and finite logprobs < 0 at positions ``starts .. starts + k``
    of each response: ``(n, k)`` arrays, a function of (seed, position) alone (a rewound response
    draws the same ids again). Logprobs are -(1e-3 + Exp(2)), capped at -20."""
    pos = starts.astype(np.uint64)[:, None] + np.arange(1, k + 1, dtype=np.uint64)
    h = _mix(_mix(seeds.astype(np.uint64))[:, None] + pos * _GOLDEN)
    u = (_mix(h ^ _SALT) >> np.uint64(11)).astype(np.float64) * 2.0**-53  # uniform in [0, 1)
    return (h % np.uint64(vocab_size)).astype(np.int64), -np.minimum(20.0, 1e-3 - np.log1p(-u) / 2.0)


_GOLDEN, _SALT = np.uint64(0x9E3779B97F4A7C15), np.uint64(0x5851F42D4C957F2D)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: 64 well-mixed bits from any 64 (uint64 arithmetic wraps)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def lognormal_mean(median: float, sigma: float) -> float:
    """The uncapped lognormal's mean, ``median · exp(sigma² / 2)`` (for sizing runs by hand)."""
    return median * math.exp(sigma * sigma / 2.0)
