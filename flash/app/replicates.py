"""Replicates: runs that differ only by seed (or repeat index) are one setting measured n times.

A sweep's ``seed=0,1,2`` (or ``--repeats 3``) is not a choice to recommend but a sample of the
noise: RL accuracy moves with the seed and seconds per step with the machine's load. So runs are
grouped by their *setting* (every swept key but the replicate keys, ``seed`` and ``repeat``) and each
setting is reported as a mean with its standard error:

    mean = Σ x_i / n,    s² = Σ (x_i − mean)² / (n − 1),    SE = s / √n.

With n = 1 there is no spread to estimate: SE is ``None`` (printed "—"), never 0.

Speed-ups are paired: a run's speed-up is the seconds per step of the synchronous run with the same
other settings *and the same replicate* (seed, repeat) over its own; a setting's speed-up is the mean
± SE of its runs' ratios (side-by-side runs share the machine's load, so their ratio is steadier
than a ratio of means).

The recommendation rule (`choose`): a setting *qualifies* when its final held-out accuracy stays
within the tolerance of its synchronous setting's even after one standard error against it,

    gap = mean_acc(sync) − mean_acc(setting),   SE_gap = √(SE_sync² + SE_setting²),
    qualifies  ⇔  gap + SE_gap ≤ tolerance          (a missing SE, n = 1, counts as 0),

and the recommendation is the qualifying setting with the lowest mean seconds per step (the
synchronous setting always qualifies). A faster setting whose mean gap is within the tolerance but
whose SE is not is named *undecided*: more seeds would tell. With n = 1 everywhere the rule is the
plain one: gap ≤ tolerance.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Sequence

REPLICATE_KEYS = ("seed", "repeat")


@dataclass(frozen=True)
class Stat:
    mean: float
    se: float | None  # None when n < 2: one run says nothing of the spread
    n: int


def mean_se(values: Sequence[float]) -> Stat:
    """Mean and standard error of the mean (sample standard deviation over √n)."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_se of no values")
    if n == 1:
        return Stat(float(values[0]), None, 1)
    if min(values) == max(values):  # exact, where a rounded mean would leave a spread of 1e-17
        return Stat(float(values[0]), 0.0, n)
    mean = math.fsum(values) / n
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return Stat(mean, math.sqrt(var / n), n)


def _num(x: float, spec: str = "") -> str:
    if spec:
        return format(x, spec)
    return f"{x:.3g}" if abs(x) < 10 else f"{x:.0f}"


def fmt_stat(stat: Stat | None, spec: str = "") -> str:
    """``0.49 ± 0.005``; ``0.49 ± —`` for one run; empty for none. ``spec`` formats both numbers
    (``.2f``); without it three significant digits."""
    if stat is None:
        return ""
    return f"{_num(stat.mean, spec)} ± {'—' if stat.se is None else _num(stat.se, spec)}"


def setting_key(settings: dict[str, str], replicate_keys: Sequence[str] = REPLICATE_KEYS) -> tuple:
    """What a run chose (its swept values) with the replicate keys left out."""
    return tuple((k, v) for k, v in settings.items() if k not in replicate_keys)


@dataclass
class Group:
    """One setting: its runs (finished ones in ``rows``) and the statistics of each metric."""

    settings: dict[str, str]  # the swept keys but the replicate ones
    rows: list[dict] = field(default_factory=list)  # finished runs (status ok), one per replicate
    failed: int = 0
    stats: dict[str, Stat] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.rows)

    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.settings.items()) or "base"


def group_runs(
    runs: Sequence[tuple[dict[str, str], dict]], metrics: Sequence[str], replicate_keys: Sequence[str] = REPLICATE_KEYS
) -> list[Group]:
    """(settings, row) per run → one `Group` per setting, in first-seen order.

    A row counts when its ``status`` is ``ok``; each metric's `Stat` is over the finished rows that
    hold it (a metric no row holds is left out).
    """
    groups: dict[tuple, Group] = {}
    for settings, row in runs:
        key = setting_key(settings, replicate_keys)
        g = groups.setdefault(key, Group(dict(key)))
        if row.get("status") == "ok":
            g.rows.append(row)
        else:
            g.failed += 1
    for g in groups.values():
        for m in metrics:
            values = [float(r[m]) for r in g.rows if isinstance(r.get(m), (int, float))]
            if values:
                g.stats[m] = mean_se(values)
    return list(groups.values())


@dataclass(frozen=True)
class Verdict:
    gap: float  # sync mean accuracy − this setting's (positive: accuracy lost)
    se: float  # SE of the gap, √(SE_sync² + SE²), a missing SE counted as 0
    qualifies: bool  # gap + se ≤ tolerance
    undecided: bool  # gap ≤ tolerance < gap + se: the mean is within, the error is not


def judge(acc: Stat, sync_acc: Stat, tolerance: float) -> Verdict:
    """The rule of the module docstring for one setting against its synchronous one."""
    gap = sync_acc.mean - acc.mean
    se = math.hypot(sync_acc.se or 0.0, acc.se or 0.0)
    edge = tolerance + 1e-12  # a gap of exactly the tolerance is within it, float rounding aside
    return Verdict(gap, se, gap + se <= edge, gap <= edge < gap + se)


def choose(
    pairs: Sequence[tuple[Group, Group]], tolerance: float, acc: str = "acc_final", speed: str = "s_per_step"
) -> tuple[Group | None, list[tuple[Group, Verdict]]]:
    """(setting, its synchronous setting) pairs → (recommended setting, faster undecided ones).

    Recommended: the lowest mean ``speed`` among settings that qualify (a synchronous setting, paired
    with itself, always does); undecided: settings faster than it whose mean is within the tolerance
    but not its error, fastest first. Settings with no finished run are skipped.
    """
    done = [(g, b) for g, b in pairs if g.n and b.n and acc in g.stats and speed in g.stats]
    ok = [g for g, b in done if g is b or judge(g.stats[acc], b.stats[acc], tolerance).qualifies]
    if not ok:
        return None, []
    best = min(ok, key=lambda g: g.stats[speed].mean)
    undecided = [
        (g, v)
        for g, b in done
        if g is not b
        and (v := judge(g.stats[acc], b.stats[acc], tolerance)).undecided
        and g.stats[speed].mean < best.stats[speed].mean
    ]
    return best, sorted(undecided, key=lambda gv: gv[0].stats[speed].mean)


def spread(values: Sequence[float], digits: int = 4) -> dict[str, float | int | None]:
    """Median, mean, SE and n of a benchmark's repeats, rounded for a JSON line (SE None for n = 1)."""
    s = mean_se(values)
    return {
        "median": round(statistics.median(values), digits),
        "mean": round(s.mean, digits),
        "se": None if s.se is None else round(s.se, digits),
        "n": s.n,
    }


def paired_ratios(base: dict[tuple, float], other: dict[tuple, float]) -> list[float]:
    """``base[k] / other[k]`` for every pair key both hold (a pair is a replicate run side by side)."""
    return [base[k] / other[k] for k in base if k in other and other[k] > 0]
