"""Step metrics as tagged tensors: combined on the device, moved to the host once per step.

A metric is a 0-dim detached tensor (or a plain number) tagged with how it combines over the
micro-batches of an optimizer step and over the FSDP ranks (``Metric``):

- ``mean``: weighted by the micro-batch's share of the step (its ``weight``: masked tokens for
  ``token-mean``, rows for the ``seq-mean-*`` modes), or by its own ``weight`` when it measures
  other tokens than the loss does (the mismatch on the tokens the current weights made). A metric
  with its own weight that sums to 0 over the step measured nothing and is left out.
- ``max`` / ``min``: the largest / smallest over the step; an empty one (nothing to take it
  over, the identity -inf / +inf) reads 0.
- ``sum``: added up (``tokens``).

The producer declares the reduction (``mean(x)``, ``maximum(x)``, ``minimum(x)``, ``total(x)``);
a bare value (a user's plugin loss returning floats or tensors) is a mean. ``StepMetrics`` adds
micro-batches up on the device without reading a value, and ``partials`` moves every value to the
host in one transfer (one ``tolist``); ``combine`` adds FSDP ranks' partials by their reduction
and ``finalize`` turns partials into ``dict[str, float]``.

A leaf: imports nothing of the project.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Sequence

import torch

REDUCES = ("mean", "max", "min", "sum")
Number = torch.Tensor | float
_IDENTITY = {"max": -math.inf, "min": math.inf}


@dataclass(frozen=True)
class Metric:
    """One metric of a micro-batch: ``value`` (0-dim, detached, or a number), how it combines
    (``reduce``, one of ``REDUCES``) and, for a metric over its own tokens, their ``weight``."""

    value: Number
    reduce: str = "mean"
    weight: Number | None = None

    def __post_init__(self) -> None:
        if self.reduce not in REDUCES:
            raise ValueError(f"metric reduction must be one of {REDUCES}, got {self.reduce!r}")

    def __float__(self) -> float:
        """The value on its own (a host read): an empty max / min reads 0."""
        return finalize(_single(self)).get("m", 0.0)


def _detached(value: Any) -> Number:
    return value.detach() if isinstance(value, torch.Tensor) else float(value)


def mean(value: Any, weight: Number | None = None) -> Metric:
    """A mean over the step; ``weight``: the tokens it was taken over, when they are its own."""
    return Metric(_detached(value), "mean", weight)


def maximum(value: Any, weight: Number | None = None) -> Metric:
    """The largest over the step; a part with ``weight`` 0 takes no part."""
    return Metric(_detached(value), "max", weight)


def minimum(value: Any, weight: Number | None = None) -> Metric:
    """The smallest over the step; a part with ``weight`` 0 takes no part."""
    return Metric(_detached(value), "min", weight)


def total(value: Any) -> Metric:
    """A sum over the step."""
    return Metric(_detached(value), "sum")


def tagged(value: Any) -> Metric:
    """``value`` as a ``Metric``: a Metric as it is, a bare number or tensor as a mean."""
    return value if isinstance(value, Metric) else mean(value)


class Partial(NamedTuple):
    """A metric's share on the host: the reduced value (a mean's weighted sum) and, for a metric
    with its own weight, that weight summed (None: the step's weight is its divisor)."""

    reduce: str
    value: float
    weight: float | None = None


@dataclass
class Partials:
    """One step's (or one rank's share of one step's) metrics on the host."""

    weight: float  # the micro-batches' weight summed: the divisor of the plain means
    metrics: dict[str, Partial] = field(default_factory=dict)


def _is_zero(w: Number) -> bool:
    """A weight known on the host to be 0 (a padding pass); a tensor is never read."""
    return not isinstance(w, torch.Tensor) and w == 0


class StepMetrics:
    """Tagged metrics of the micro-batches of one optimizer step, combined without a host read.

    ``add(metrics, weight)`` per micro-batch; ``weight`` (a tensor, or a number known on the host)
    also sums into ``weight``, the step's divisor. A part whose weight is the number 0 (an FSDP
    padding pass) adds nothing. Means are summed in float64, as the host would."""

    def __init__(self) -> None:
        self.weight: Number = 0.0
        self._reduce: dict[str, str] = {}
        self._value: dict[str, Number] = {}
        self._own: dict[str, Number] = {}  # the summed own weight of metrics that carry one

    def add(self, metrics: Mapping[str, Any], weight: Number) -> None:
        if _is_zero(weight):
            return
        self.weight = self.weight + _f64(weight)
        for name, raw in metrics.items():
            m = tagged(raw)
            if self._reduce.setdefault(name, m.reduce) != m.reduce:
                raise ValueError(f"metric {name!r} is a {self._reduce[name]} and a {m.reduce}")
            self._add(name, m, weight)

    def _add(self, name: str, m: Metric, weight: Number) -> None:
        value, prev = _f64(m.value), self._value.get(name)
        if m.weight is not None:
            self._own[name] = self._own.get(name, 0.0) + _f64(m.weight)
        if m.reduce == "mean":
            part = value * _f64(weight if m.weight is None else m.weight)
            self._value[name] = part if prev is None else prev + part
        elif m.reduce == "sum":
            self._value[name] = value if prev is None else prev + value
        else:
            if m.weight is not None and isinstance(m.weight, torch.Tensor):
                value = torch.where(m.weight > 0, value, _IDENTITY[m.reduce])
            elif m.weight is not None and m.weight == 0:
                return
            pick = torch.maximum if m.reduce == "max" else torch.minimum
            self._value[name] = value if prev is None else _pick(pick, prev, value)

    def weighted_sum(self, name: str, device: torch.device) -> torch.Tensor:
        """A fresh ``[1]`` float64 tensor on ``device`` holding ``name``'s running value (a mean's
        weighted sum; 0 if no part reported it), for a collective to reduce in place."""
        value = self._value.get(name, 0.0)
        if isinstance(value, torch.Tensor):
            return value.detach().reshape(1).to(device=device, dtype=torch.float64, copy=True)
        return torch.tensor([value], dtype=torch.float64, device=device)

    def partials(self, *extra: torch.Tensor) -> tuple[Partials, list[float]]:
        """Every value on the host in one transfer (per device), with ``extra`` 0-dim tensors
        (the gradient norm, ...) read in the same transfer; returns (partials, extra floats)."""
        names = list(self._value)
        own = list(self._own)
        read = host([self.weight, *(self._value[n] for n in names), *(self._own[n] for n in own), *extra])
        weight, values = read[0], read[1 : 1 + len(names)]
        owned = dict(zip(own, read[1 + len(names) : 1 + len(names) + len(own)]))
        metrics = {n: Partial(self._reduce[n], v, owned.get(n)) for n, v in zip(names, values)}
        return Partials(weight, metrics), read[1 + len(names) + len(own) :]

    def floats(self) -> dict[str, float]:
        """The step's metrics as floats (one transfer)."""
        return finalize(self.partials()[0])


def _f64(x: Number) -> Number:
    return x.double() if isinstance(x, torch.Tensor) else float(x)


def _pick(fn, a: Number, b: Number) -> Number:
    if isinstance(b, torch.Tensor) and not isinstance(a, torch.Tensor):
        a = torch.tensor(a, dtype=torch.float64, device=b.device)
    if isinstance(a, torch.Tensor):
        b = b if isinstance(b, torch.Tensor) else torch.tensor(b, dtype=torch.float64, device=a.device)
        return fn(a, b)
    return max(a, b) if fn is torch.maximum else min(a, b)


def host(values: Sequence[Number]) -> list[float]:
    """``values`` as floats: the tensors among them stacked and read with one ``tolist`` per
    device (one in practice); numbers pass through."""
    out: list[Any] = list(values)
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(out):
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
        else:
            out[i] = float(v)
    for idx in by_device.values():
        stacked = torch.stack([out[i].reshape(()).to(torch.float64) for i in idx])
        for i, v in zip(idx, stacked.tolist()):
            out[i] = v
    return out


def combine(parts: Sequence[Partials]) -> Partials:
    """Ranks' partials of one step as one: weights and means' sums add, max / min take the
    largest / smallest, sums add (a metric a rank did not report takes no part)."""
    out = Partials(sum(p.weight for p in parts))
    for p in parts:
        for name, m in p.metrics.items():
            prev = out.metrics.get(name)
            if prev is None:
                out.metrics[name] = m
                continue
            if prev.reduce != m.reduce:
                raise ValueError(f"metric {name!r} is a {prev.reduce} and a {m.reduce}")
            if m.reduce in ("mean", "sum"):
                value = prev.value + m.value
            else:
                value = (max if m.reduce == "max" else min)(prev.value, m.value)
            weight = None if m.weight is None else (prev.weight or 0.0) + m.weight
            out.metrics[name] = Partial(m.reduce, value, weight)
    return out


def finalize(parts: Partials) -> dict[str, float]:
    """The metrics as floats: means divided by their weight (the step's, floored at 1e-12, or
    their own), an empty max / min as 0, a metric whose own weight is 0 left out."""
    out: dict[str, float] = {}
    for name, m in parts.metrics.items():
        if m.weight is not None and m.weight == 0:
            continue
        if m.reduce == "mean":
            out[name] = m.value / (max(parts.weight, 1e-12) if m.weight is None else m.weight)
        elif m.reduce in _IDENTITY and m.value == _IDENTITY[m.reduce]:
            out[name] = 0.0
        else:
            out[name] = m.value
    return out


def _single(metric: Metric) -> Partials:
    acc = StepMetrics()
    acc.add({"m": metric}, 1.0)
    return acc.partials()[0]


def to_floats(metrics: Mapping[str, Any]) -> dict[str, float]:
    """One micro-batch's metrics as floats, as a step of that micro-batch alone reports them."""
    acc = StepMetrics()
    acc.add(metrics, 1.0)
    return acc.floats()
