"""Replicates (flash/app/replicates.py): mean ± SE per setting, the recommendation rule, paired ratios.

Every expected number is worked out by hand in the comment beside it.
"""

import math

import pytest

from flash.app.replicates import Group, Stat, choose, fmt_stat, group_runs, judge, mean_se, paired_ratios


def test_mean_and_standard_error_by_hand():
    # mean 0.6; deviations -0.1, 0, 0.1 → s² = 0.02 / 2 = 0.01, s = 0.1; SE = 0.1 / √3 = 0.057735
    s = mean_se([0.5, 0.6, 0.7])
    assert (s.mean, s.n) == (pytest.approx(0.6), 3) and s.se == pytest.approx(0.1 / math.sqrt(3))
    # mean 32/15 = 2.1333; deviations -2/15, 4/15, -2/15 → s² = (24/225) / 2 = 12/225; SE = √(12/225/3) = 2/15
    s = mean_se([2.0, 2.4, 2.0])
    assert s.mean == pytest.approx(32 / 15) and s.se == pytest.approx(2 / 15)
    assert mean_se([0.4, 0.4]) == Stat(0.4, 0.0, 2)  # equal runs: a measured spread of exactly zero
    assert mean_se([0.5 - 0.1] * 3) == Stat(0.4, 0.0, 3)
    with pytest.raises(ValueError):
        mean_se([])


def test_one_run_has_no_standard_error_not_a_zero_one():
    s = mean_se([0.42])
    assert s == Stat(0.42, None, 1)
    assert fmt_stat(s) == "0.42 ± —" and fmt_stat(s, ".3f") == "0.420 ± —"
    assert fmt_stat(mean_se([0.5, 0.6, 0.7])) == "0.6 ± 0.0577" and fmt_stat(None) == ""


def test_group_runs_by_setting_with_seeds_and_repeats_as_replicates():
    runs = [({"async_ratio": "0", "seed": "0"}, {"status": "ok", "acc": 0.50, "s": 1.0}),
            ({"async_ratio": "2", "seed": "0"}, {"status": "ok", "acc": 0.48, "s": 0.5}),
            ({"async_ratio": "0", "seed": "1"}, {"status": "ok", "acc": 0.54, "s": 1.2}),
            ({"async_ratio": "2", "seed": "1"}, {"status": "failed"}),
            ({"async_ratio": "0", "seed": "2", "repeat": "1"}, {"status": "ok", "acc": 0.52, "s": 1.1})]
    sync, fast = group_runs(runs, ["acc", "s", "missing"])
    assert sync.settings == {"async_ratio": "0"} and sync.label() == "async_ratio=0"
    assert (sync.n, sync.failed, fast.n, fast.failed) == (3, 0, 1, 1)
    # acc 0.50, 0.54, 0.52: mean 0.52, s = 0.02, SE = 0.02/√3 = 0.011547
    assert sync.stats["acc"].mean == pytest.approx(0.52) and sync.stats["acc"].se == pytest.approx(0.011547, abs=1e-6)
    assert sync.stats["s"].mean == pytest.approx(1.1) and "missing" not in sync.stats
    assert fast.stats["acc"] == Stat(0.48, None, 1)


def test_the_rule_counts_one_standard_error_of_the_gap_against_a_setting():
    sync = Stat(0.50, 0.01, 3)
    # gap 0.01, SE of the gap √(0.01² + 0.02²) = 0.022361: 0.032361 > 0.025, mean alone is within
    v = judge(Stat(0.49, 0.02, 3), sync, 0.025)
    assert v.gap == pytest.approx(0.01) and v.se == pytest.approx(0.022361, abs=1e-6)
    assert (v.qualifies, v.undecided) == (False, True)
    assert judge(Stat(0.49, 0.02, 3), sync, 0.04).qualifies
    # one run each: no SE, the plain rule; a gap of exactly the tolerance is within it
    assert judge(Stat(0.48, None, 1), Stat(0.50, None, 1), 0.02).qualifies
    assert not judge(Stat(0.47, None, 1), Stat(0.50, None, 1), 0.02).qualifies


def _setting(ratio: str, accs: list[float], speeds: list[float]) -> Group:
    g = Group({"async_ratio": ratio}, rows=[{"status": "ok"}] * len(accs))
    g.stats = {"acc_final": mean_se(accs), "s_per_step": mean_se(speeds)}
    return g


def test_choose_picks_on_the_means_and_names_the_undecided():
    sync = _setting("0", [0.50, 0.50, 0.50], [1.0, 1.2, 1.1])
    r2 = _setting("2", [0.49, 0.50, 0.48], [0.5, 0.5, 0.55])  # gap 0.01 + SE 0.00577 ≤ 0.025
    r4 = _setting("4", [0.52, 0.40, 0.42], [0.35, 0.30, 0.40])  # one seed is best, the mean is 0.0533 down
    r8 = _setting("8", [0.50, 0.44, 0.50], [0.2, 0.2, 0.2])  # gap 0.02 within, + SE 0.02 not: undecided
    best, undecided = choose([(sync, sync), (r2, sync), (r4, sync), (r8, sync)], 0.025)
    assert best is r2
    assert [(g.label(), round(v.gap, 4), round(v.se, 4)) for g, v in undecided] == [("async_ratio=8", 0.02, 0.02)]
    # nothing asynchronous qualifies: the synchronous setting is the answer; no finished sync: none
    assert choose([(sync, sync), (r4, sync)], 0.025) == (sync, [])
    assert choose([(r2, Group({"async_ratio": "0"}))], 0.025) == (None, [])


def test_paired_ratios_pair_by_replicate():
    sync = {("seed", "0"): 1.0, ("seed", "1"): 1.2, ("seed", "2"): 1.1}
    fast = {("seed", "0"): 0.5, ("seed", "1"): 0.5}  # seed 2 failed: no pair
    assert paired_ratios(sync, fast) == pytest.approx([2.0, 2.4])
