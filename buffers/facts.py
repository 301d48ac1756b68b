"""Facts: the numbers an agent or environment reports about its episode beside the reward.

An agent returns ``(reward, {"tool_calls": 3, "solved": True, "log": "..."})`` (an environment's
last step returns its ``info``); the dict's numeric entries are the episode's facts. They ride in the sample's ``meta["facts"]`` (``Sample.facts``), so
every encoding that carries a sample -- checkpoints (``flash.buffers.codec``), the buffer service's wire
-- carries them; each trained sample's ledger line lists them, and a step's metrics average each
one over the step's trained samples that report it (``agent/<name>``, flash.controllers.step_metrics).

``clean_facts`` keeps a fact when its key is a metric-safe name (letters, digits, ``_ . -``; at most
``MAX_KEY_CHARS``) not taken by the agent workflow's own metrics (``RESERVED``), and its value a
finite real number (a bool counts as 0 or 1); at most ``MAX_FACTS`` per episode. Every other entry
is dropped and counted by reason: ``bad_key``, ``reserved``, ``non_numeric``, ``non_finite``,
``too_many``.
"""

from __future__ import annotations

import math
import numbers
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

FACTS = "facts"  # the sample meta key
MAX_FACTS = 32
MAX_KEY_CHARS = 64
# the agent workflow's own agent/* metrics (flash.envs.agents outcomes and retries, untrained tokens)
RESERVED = frozenset({"ok", "timeout", "crashed", "bad_return", "cancelled", "died", "retries", "untrained_tokens"})
DROP_REASONS = ("bad_key", "reserved", "non_numeric", "non_finite", "too_many")
_KEY = re.compile(r"[A-Za-z0-9_.\-]+")


def _number(value: Any) -> float | None:
    """``value`` as a float when it is a real number (bool, int, float, NumPy scalar), else None."""
    if isinstance(value, numbers.Real):
        try:
            return float(value)
        except (OverflowError, ValueError):  # an int beyond float's range
            return math.inf
    return None


def clean_facts(info: Mapping[str, Any]) -> tuple[dict[str, float], Counter]:
    """(the facts of ``info``, the entries dropped per reason); see the module docstring."""
    facts: dict[str, float] = {}
    dropped: Counter = Counter()
    for key, value in info.items():
        if not isinstance(key, str) or len(key) > MAX_KEY_CHARS or not _KEY.fullmatch(key):
            dropped["bad_key"] += 1
        elif key in RESERVED or key.startswith("facts_dropped"):
            dropped["reserved"] += 1
        elif (number := _number(value)) is None:
            dropped["non_numeric"] += 1
        elif not math.isfinite(number):
            dropped["non_finite"] += 1
        elif len(facts) >= MAX_FACTS:
            dropped["too_many"] += 1
        else:
            facts[key] = number
    return facts, dropped


def facts_means(all_facts: Iterable[Mapping[str, float]], prefix: str = "agent") -> dict[str, float]:
    """``{prefix/name: mean}`` of each fact over the dicts that report it."""
    sums: dict[str, float] = {}
    counts: Counter = Counter()
    for facts in all_facts:
        for key, value in facts.items():
            sums[key] = sums.get(key, 0.0) + value
            counts[key] += 1
    return {f"{prefix}/{key}": sums[key] / counts[key] for key in sorted(sums)}
