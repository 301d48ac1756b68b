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
    runs = [
        ({"async_ratio": "0", "seed": "0"}, {"status": "ok", "acc": 0.50, "s": 1.0}),
        ({"async_ratio": "2", "seed": "0"}, {"status": "ok", "acc": 0.48, "s": 0.5}),
        ({"async_ratio": "0", "seed": "1"}, {"status": "ok", "acc": 0.54, "s": 1.2}),
        ({"async_ratio": "2", "seed": "1"}, {"status": "failed"}),
        ({"async_ratio": "0", "seed": "2", "repeat": "1"}, {"status": "ok", "acc": 0.52, "s": 1.1}),
    ]
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


def _summary(s_per_step: float, acc: float) -> dict:
    return {
        "seconds_per_step": s_per_step,
        "eval_accuracy_final": acc,
        "eval_accuracy_initial": 0.281,
        "wall_seconds": 100 * s_per_step,
        "max_staleness_observed": 0.0,
        "phase_seconds_mean": {"train": s_per_step / 2},
    }


def test_async_speedup_bench_pairs_runs_and_reports_mean_and_se():
    """The quiet run of BENCHMARKS.md: sync 0.546, 0.600, 0.579 s/step beside async 0.419, 0.417, 0.398."""
    from bench.async_speedup import report_line, summarize

    sync = [_summary(0.546, 0.555), _summary(0.600, 0.555), _summary(0.579, 0.555)]
    fast = [_summary(0.419, 0.555), _summary(0.417, 0.578), _summary(0.398, 0.586)]
    rows = summarize({0.0: sync, 2.0: fast})
    r2 = rows["2.0"]
    # per pair 0.546/0.419 = 1.3031, 0.600/0.417 = 1.4388, 0.579/0.398 = 1.4548: median 1.4388,
    # mean 1.3989; deviations -0.0958, 0.0399, 0.0559 → s = 0.0834, SE = 0.0481
    assert r2["speedup_vs_first_per_pair"] == [1.3031, 1.4388, 1.4548]
    assert (r2["speedup_vs_first_median"], r2["speedup_vs_first_mean"], r2["speedup_vs_first_se"]) == (
        1.4388,
        1.3989,
        0.0481,
    )
    # accuracy 0.555, 0.578, 0.586: mean 0.573; deviations -0.018, 0.005, 0.013 → s = 0.01609, SE = 0.0093
    assert (r2["eval_accuracy_final_median"], r2["eval_accuracy_final_mean"], r2["eval_accuracy_final_se"]) == (
        0.578,
        0.573,
        0.0093,
    )
    assert r2["seconds_per_step_median"] == 0.417 and r2["n_pairs"] == 3
    assert rows["0.0"]["speedup_vs_first_mean"] == 1.0 and rows["0.0"]["eval_accuracy_final_se"] == 0.0
    assert report_line("2.0", "0.0", r2).startswith(
        "r=2.0 (n=3): 0.411 ± 0.007 s/step (median 0.417), speed-up vs r=0.0 1.40 ± 0.05x (median 1.44x; "
        "per pair 1.30, 1.44, 1.45)"
    )
    one = summarize({0.0: sync[:1], 2.0: fast[:1]})["2.0"]
    assert one["speedup_vs_first_se"] is None and "1.30 ± —x" in report_line("2.0", "0.0", one)


def test_async_speedup_bench_runs_each_seed_side_by_side(monkeypatch):
    import bench.async_speedup as bench

    calls = []

    def run_once(recipe, ratio, run_dir, overrides):
        calls.append((ratio, overrides[-1]))
        seed = int(overrides[-1].split("=")[1])
        return _summary((1.0 + 0.1 * seed) / (1 + ratio / 2), 0.5)

    monkeypatch.setattr(bench, "run_once", run_once)
    result = bench.main(["--repeats", "1", "--seeds", "0,1,2", "--ratios", "0,2", "train.steps=3"])
    assert calls == [(r, f"seed={s}") for s in (0, 1, 2) for r in (0.0, 2.0)]
    r2 = result["per_ratio"]["2.0"]
    assert result["seeds"] == [0, 1, 2] and r2["n_pairs"] == 3
    assert r2["speedup_vs_first_per_pair"] == [2.0, 2.0, 2.0] and r2["speedup_vs_first_se"] == 0.0
    # s/step 0.5, 0.55, 0.6: mean 0.55, SE 0.05/√3 = 0.0289
    assert (r2["seconds_per_step_mean"], r2["seconds_per_step_se"]) == (0.55, 0.0289)


def test_tail_batching_bench_reports_paired_ratios_with_their_error():
    from bench.tail_batching import summarize_setting, summary_line

    def run(s_per_step: float, acc: float) -> dict:
        return {
            **_summary(s_per_step, acc),
            "step_median_s": s_per_step,
            "samples_trained": 2560,
            "engine_tokens": 14000.0,
            "tail": {},
        }

    sync = [run(0.575, 0.465), run(0.537, 0.465), run(0.508, 0.465)]
    tail = [run(0.430, 0.480), run(0.458, 0.480), run(0.450, 0.480)]
    row = summarize_setting(tail, sync)
    # per pair 0.575/0.430 = 1.3372, 0.537/0.458 = 1.1725, 0.508/0.450 = 1.1289: median 1.1725,
    # mean 1.2129; deviations 0.1243, -0.0404, -0.0840 → s = 0.1098, SE = 0.0634
    assert (row["speedup_vs_first_median"], row["speedup_vs_first_mean"], row["speedup_vs_first_se"]) == (
        1.1725,
        1.2129,
        0.0634,
    )
    assert row["seconds_per_step_median"] == 0.450 and row["eval_accuracy_final_se"] == 0.0
    assert (
        summary_line("sync_tail", "sync", row)
        == "sync_tail (n=3): speed-up vs sync 1.21 ± 0.06x (median 1.17x), final acc 0.480 ± 0.000"
    )
