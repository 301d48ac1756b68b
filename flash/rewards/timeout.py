"""Adaptive sandbox timeout (RollPacker, arXiv 2509.21009, reward scheduler).

    T = min(max(T_min, lambda * T_anchor), T_max)

``T_anchor`` is the slowest *correct* run seen so far for a task family. A fixed timeout must be
set for the slowest honest solution, so every solution that loops forever burns all of it;
anchoring on correct runs lets the timeout shrink to a margin ``lambda`` above what correct code
actually needs, and grow again (never past ``T_max``) when a slower correct run shows up.

Departure from the paper: before the first correct run of a family there is no anchor, and we use
``T_max`` (generous until we know better) rather than a guess.
"""

from __future__ import annotations

import math
import threading


class AdaptiveTimeout:
    def __init__(self, t_min: float, t_max: float, lam: float) -> None:
        for name, value in (("t_min", t_min), ("t_max", t_max), ("lam", lam)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"adaptive timeout {name} must be a finite number > 0, got {value}")
        if t_min > t_max:
            raise ValueError(f"adaptive timeout needs t_min <= t_max, got {t_min} > {t_max}")
        self.t_min, self.t_max, self.lam = float(t_min), float(t_max), float(lam)
        self._anchor: dict[str, float] = {}
        self._lock = threading.Lock()

    def anchor(self, family: str = "default") -> float | None:
        """The slowest correct run seen for ``family`` (seconds), or None before the first."""
        with self._lock:
            return self._anchor.get(family)

    def timeout(self, family: str = "default") -> float:
        """The timeout the next run of ``family`` gets."""
        anchor = self.anchor(family)
        if anchor is None:
            return self.t_max
        return min(max(self.t_min, self.lam * anchor), self.t_max)

    def observe(self, wall_s: float, correct: bool, family: str = "default") -> None:
        """Record a finished run; only correct runs move the anchor (and only upwards)."""
        if not correct:
            return
        with self._lock:
            self._anchor[family] = max(self._anchor.get(family, 0.0), float(wall_s))

    def metrics(self, prefix: str = "sandbox/timeout") -> dict[str, float]:
        """The knobs and, per family seen, the anchor and the running T."""
        out = {f"{prefix}/t_min": self.t_min, f"{prefix}/t_max": self.t_max, f"{prefix}/lambda": self.lam}
        with self._lock:
            families = dict(self._anchor)
        for family, anchor in sorted(families.items()):
            out[f"{prefix}/anchor/{family}"] = anchor
            out[f"{prefix}/T/{family}"] = self.timeout(family)
        return out
