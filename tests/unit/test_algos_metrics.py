"""Tagged step metrics (``flash.algos.metrics``) and the one mismatch measure, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from flash.algos import mismatch_metrics
from flash.algos.metrics import StepMetrics, combine, finalize, maximum, mean, minimum, to_floats, total


def t(x: float) -> torch.Tensor:
    return torch.tensor(x)


def parts():
    """Three micro-batches: (metrics, weight). The second's own-weight metric measured nothing."""
    return [
        (
            {
                "loss": t(1.0),
                "r/max": maximum(t(3.0)),
                "r/min": minimum(t(0.5)),
                "tokens": total(t(4.0)),
                "mm": mean(t(0.2), t(4.0)),
                "plain": 2.0,
            },
            t(4.0),
        ),
        (
            {
                "loss": t(4.0),
                "r/max": maximum(t(7.0)),
                "r/min": minimum(t(0.25)),
                "tokens": total(t(1.0)),
                "mm": mean(t(9.0), t(0.0)),
                "plain": 5.0,
            },
            t(1.0),
        ),
        (
            {
                "loss": t(2.0),
                "r/max": maximum(t(1.0)),
                "r/min": minimum(t(math.inf)),
                "tokens": total(t(3.0)),
                "mm": mean(t(0.6), t(2.0)),
                "plain": 1.0,
            },
            3.0,
        ),
    ]


WANT = {
    "loss": (4 * 1 + 1 * 4 + 3 * 2) / 8,
    "r/max": 7.0,
    "r/min": 0.25,
    "tokens": 8.0,
    "mm": (0.2 * 4 + 0.6 * 2) / 6,
    "plain": (4 * 2 + 5 + 3 * 1) / 8,
}


def test_micro_batches_combine_by_their_declared_reduction():
    acc = StepMetrics()
    for metrics, weight in parts():
        acc.add(metrics, weight)
    got = acc.floats()
    assert got.keys() == WANT.keys()
    for key, value in WANT.items():
        assert got[key] == pytest.approx(value, rel=1e-6), key


def test_ranks_combine_like_one_step_and_padding_passes_add_nothing():
    rank0, rank1 = StepMetrics(), StepMetrics()
    (m0, w0), (m1, w1), (m2, w2) = parts()
    rank0.add(m0, w0)
    rank0.add(m1, 0.0)  # a padding pass: weight 0, nothing counted (its max 7 would otherwise win)
    rank1.add(m1, w1)
    rank1.add(m2, w2)
    got = finalize(combine([rank0.partials()[0], rank1.partials()[0], StepMetrics().partials()[0]]))
    for key, value in WANT.items():
        assert got[key] == pytest.approx(value, rel=1e-6), key
    lone = StepMetrics()
    lone.add(m0, w0)
    lone.add(m1, 0.0)
    assert lone.floats()["r/max"] == 3.0


def test_empty_extremes_read_zero_and_unmeasured_own_means_are_left_out():
    assert to_floats(
        {"a/max": maximum(t(-math.inf)), "a/min": minimum(t(math.inf)), "m": mean(t(0.0), t(0.0)), "x": t(2.0)}
    ) == {"a/max": 0.0, "a/min": 0.0, "x": 2.0}
    acc = StepMetrics()
    acc.add({"a": maximum(t(1.0))}, 1.0)
    with pytest.raises(ValueError, match="is a max and a mean"):
        acc.add({"a": mean(t(1.0))}, 1.0)


def test_mismatch_by_hand():
    """Tokens (0,0), (0,1), (1,0) counted: log ρ = prox − behav = 0.5, −1, 0 (the padding's 9 is
    not); mean |log ρ| = 0.5, max 1, k3 = mean(e^x − 1 − x)."""
    behav = torch.zeros(2, 2)
    prox = torch.tensor([[0.5, -1.0], [0.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    got = to_floats(mismatch_metrics(behav, prox, mask))
    k3 = [math.expm1(x) - x for x in (0.5, -1.0, 0.0)]
    assert got == pytest.approx({"mismatch_mean": 0.5, "mismatch_max": 1.0, "mismatch_kl": sum(k3) / 3})
    assert to_floats(mismatch_metrics(behav, prox, torch.zeros(2, 2))) == {}
