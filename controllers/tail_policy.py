"""Tail batching (RollPacker, arXiv 2509.21009 §4): the pure rules, apart from the scheduler.

A synchronous RL step waits for its longest response; with a heavy length tail most of the batch
has finished long before, and the engine idles. RollPacker splits rollout into rounds:

- **short rounds** launch more prompts than a batch needs (``over_provision``), cap every response
  at a length *threshold*, keep the first groups to finish, and *cut* a group as a whole (the group
  rule: a prompt's ``n`` samples stay together) when any of its responses reaches the threshold, or
  when the round is full before it finished; the cut prompt goes to the **long-prompt queue**;
- **long rounds** (when the queue holds ``long_round_queue`` prompts, or every ``long_round_every``
  steps) take their prompts from that queue and run them whole, at full length, so long responses
  decode beside each other instead of beside a batch of short ones.

The threshold is an absolute token count, a percentile of recent groups' longest responses, or ``inf``
(never cut: with ``over_provision = 1`` the mode is then plain synchronous training, tested).
Departure from the paper: RollPacker's short rounds end by wall-clock once enough prompts finish;
here a response is cut by its length (the engine stops it at the threshold), which depends on
the sampled tokens only, so runs are reproducible and a cut is explained by one number.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Literal, get_args

# rollout.scheduler: plain, or tail_batching (this module's policy, controllers/tail_batching.py)
SchedulerKind = Literal["plain", "tail_batching"]
SCHEDULERS: tuple[str, ...] = get_args(SchedulerKind)


@dataclass
class TailConfig:
    # "p90": cut at the 90th percentile of recent groups' longest responses (the group rule cuts
    # by the longest, so ~10% of groups are cut); "48": at 48 tokens; "inf": never cut. A response
    # is cut when it reaches the threshold without ending.
    threshold: str = "p90"
    window: int = 512  # recent groups the percentile is taken over
    over_provision: float = 1.25  # a short round launches ceil(f * B) prompts, keeps the first B
    long_round_queue: int = 0  # run a long round once this many prompts wait; 0 = train.prompts_per_step
    long_round_every: int = 0  # also run one every k steps when the queue is not empty; 0 = off


def parse_threshold(text: str) -> tuple[str, float]:
    """``("percentile", p)``, ``("tokens", L)`` or ``("inf", inf)``; a ValueError names the forms."""
    s = str(text).strip().lower()
    try:
        if s in ("inf", "infinity", "none"):
            return "inf", math.inf
        if s.startswith("p"):
            p = float(s[1:])
            if 0 < p <= 100:
                return "percentile", p
        elif float(s) == int(float(s)) and int(float(s)) >= 1:
            return "tokens", float(int(float(s)))
    except ValueError:
        pass
    raise ValueError(
        f"rollout.tail_batching.threshold must be 'p<percentile in (0, 100]>' (e.g. p90), "
        f"a token count >= 1 (e.g. 48) or 'inf'; got '{text}'"
    )


def check_tail(cfg: TailConfig, max_new_tokens: int) -> str | None:
    """A message naming the fix for a tail-batching setting that cannot work, or None."""
    try:
        parse_threshold(cfg.threshold)
    except ValueError as exc:
        return str(exc)
    if not (cfg.over_provision >= 1 and math.isfinite(cfg.over_provision)):
        return f"rollout.tail_batching.over_provision must be a finite number >= 1, got {cfg.over_provision}"
    if cfg.window < 1:
        return f"rollout.tail_batching.window must be >= 1, got {cfg.window}"
    if cfg.long_round_queue < 0 or cfg.long_round_every < 0:
        return "rollout.tail_batching.long_round_queue and long_round_every must be >= 0 (0 = default / off)"
    return None


def percentile(values, p: float) -> int:
    """Nearest-rank percentile: the smallest value with at least p% of ``values`` at or below it."""
    ordered = sorted(values)
    return int(ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)])


class LengthThreshold:
    """The short-round cap in tokens, from the configured rule and recent (group) lengths.

    ``cap()`` is None when nothing is cut: threshold ``inf``, a threshold at or past
    ``max_new_tokens`` (no response can pass it), or a percentile before ``min_history`` lengths
    were seen (the first rounds run whole and teach the length distribution). A cut group is
    recorded at the cap (it is at least that long), so the percentile sees the tail it cuts.
    """

    def __init__(self, threshold: str, window: int, max_new_tokens: int, min_history: int):
        self.kind, self.value = parse_threshold(threshold)
        self.max_new_tokens, self.min_history = max_new_tokens, min_history
        self.lengths: deque[int] = deque(maxlen=window)

    def observe(self, length: int) -> None:
        self.lengths.append(int(length))

    def cap(self) -> int | None:
        if self.kind == "percentile":
            if len(self.lengths) < self.min_history:
                return None
            cap: float = percentile(self.lengths, self.value)
        else:
            cap = self.value
        return int(cap) if cap < self.max_new_tokens else None


def long_round_due(queued: int, version: int, queue_trigger: int, every: int) -> bool:
    """Whether the round of ``version`` runs the long-prompt queue: it holds ``queue_trigger``
    prompts, or every ``every``-th round (versions every-1, 2*every-1, ...) when it is not empty."""
    if queued == 0:
        return False
    return queued >= queue_trigger or (every > 0 and (version + 1) % every == 0)
