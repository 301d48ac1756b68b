"""Tail batching's rules (controllers/tail_policy.py), tested directly: the threshold's forms, the
strict config, the percentile cap and the long-round trigger. (The scheduler against a scripted
engine, and the real controller: test_tail_batching.py.)"""

import math

import pytest

from flash.controllers.tail_policy import (
    LengthThreshold,
    TailConfig,
    check_tail,
    long_round_due,
    parse_threshold,
    percentile,
)


def test_threshold_forms_and_bad_values_name_the_forms():
    assert parse_threshold("p90") == ("percentile", 90.0)
    assert parse_threshold("48") == ("tokens", 48.0)
    assert parse_threshold("inf") == ("inf", math.inf)
    for bad in ("p0", "p101", "0", "-3", "4.5", "fast"):
        with pytest.raises(ValueError, match="p<percentile"):
            parse_threshold(bad)
    assert check_tail(TailConfig(over_provision=0.5), 16) == (
        "rollout.tail_batching.over_provision must be a finite number >= 1, got 0.5"
    )
    assert check_tail(TailConfig(), 16) is None


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["rollout.scheduler=tail_batchin"], "did you mean 'tail_batching'"),
        (["rollout.tail_batching.over_provision=2"], "rollout.scheduler is 'plain'"),
        (["rollout.scheduler=tail_batching", "rollout.tail_batching.threshold=p0"], "p<percentile"),
        (["rollout.scheduler=tail_batching", "rollout.tail_batching.overprovision=2"], "did you mean 'over_provision'"),
    ],
)
def test_config_is_strict(overrides, needle):
    from flash.app.config import load_config, validate
    from flash.errors import ConfigError

    with pytest.raises(ConfigError, match=needle):
        validate(load_config("recipes/stutter.yaml", overrides))
    cfg = load_config("recipes/stutter.yaml", ["rollout.scheduler=tail_batching", "rollout.tail_batching.threshold=16"])
    validate(cfg)
    assert cfg.rollout.tail_batching.threshold == "16"


def test_percentile_and_cap_by_hand():
    assert percentile([5, 1, 3, 2, 4], 60) == 3  # nearest rank: ceil(0.6 * 5) = 3rd smallest
    assert percentile([5, 1, 3, 2, 4], 100) == 5
    assert percentile([7], 1) == 7
    lt = LengthThreshold("p50", window=4, max_new_tokens=10, min_history=3)
    lt.observe(2)
    lt.observe(9)
    assert lt.cap() is None  # fewer than min_history lengths: the round runs whole
    lt.observe(4)
    assert lt.cap() == 4  # sorted 2, 4, 9: the 2nd
    for x in (12, 12, 12):
        lt.observe(x)
    assert lt.cap() is None  # window keeps 4, 12, 12, 12 -> p50 = 12 >= max_new_tokens: no cap
    assert LengthThreshold("6", 4, 10, 99).cap() == 6  # absolute: no history needed
    assert LengthThreshold("10", 4, 10, 0).cap() is None and LengthThreshold("inf", 4, 10, 0).cap() is None


def test_long_round_trigger():
    assert not long_round_due(0, 5, queue_trigger=1, every=1)  # nothing queued: never
    assert long_round_due(4, 0, queue_trigger=4, every=0) and not long_round_due(3, 0, 4, 0)
    assert [long_round_due(1, v, 4, 3) for v in range(6)] == [False, False, True, False, False, True]
