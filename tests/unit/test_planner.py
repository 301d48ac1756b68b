"""`flash plan` (flash.app.plan_model, flash.app.plan): the cost model's formulas on hand-computed
values, the fit recovering known costs from a synthetic run dir, strict candidate keys, and the
predictions from a recorded trace of the default recipe against the measured runs."""

import dataclasses
import json
import statistics
from pathlib import Path

import pytest

from flash.app import plan_model as pm
from flash.app import plan as planner
from flash.errors import ConfigError

DATA = Path(__file__).parents[1] / "data" / "planner"


# ---- the model's formulas ---------------------------------------------------------------------


def test_step_time_sync_async_and_partial_overlap():
    # E = 2, g0 = 0.5, U = 1, W = 0.25, O = 0.1
    assert pm.step_time(2.0, 1.0, 0.25, 0.1, 0.5, 0.0) == pytest.approx(0.1 + 1 + 0.25 + 2.5)  # sum
    assert pm.step_time(2.0, 1.0, 0.25, 0.1, 0.5, 1.0) == pytest.approx(0.1 + 2.5)  # rollout-bound
    assert pm.step_time(0.5, 1.0, 0.25, 0.1, 0.0, 2.0) == pytest.approx(0.1 + 1.25)  # train-bound
    # r = 0.4: 0.4 × 2.5 = 1.0 of the next round hides behind U + W = 1.25
    assert pm.step_time(2.0, 1.0, 0.25, 0.1, 0.5, 0.4) == pytest.approx(0.1 + 1.25 + 2.5 - 1.0)


def test_amdahl_scaling_and_auto_threads():
    assert pm.scale(1.0, 2, 1, 0.5) == pytest.approx(1.0 / 0.75)  # (0.5 + 0.5) / (0.5 + 0.25)
    assert pm.scale(3.0, 4, 4, 0.9) == 3.0
    assert pm.scale(1.0, 1, 2, 0.0) == 1.0  # nothing parallel: threads do not help
    assert pm.auto_threads(2, 0.0) == (2, 2) and pm.auto_threads(2, 1.0) == (1, 1)
    assert pm.auto_threads(5, 2.0) == (2, 3) and pm.auto_threads(2, 2.0, trainer=2) == (1, 2)
    assert pm.oversubscription(2, 2, 2, overlap=True) == 2.0
    assert pm.oversubscription(2, 2, 2, overlap=False) == 1.0


def test_cpu_bound_step_hand_computed():
    k = pm.Costs(
        a=0.0,
        c=0.0,
        u0=0.0,
        u1=0.0,
        update_s=0.0,
        other_s=0.0,
        g0=0.0,
        engine_threads=2,
        trainer_threads=2,
        cores=2,
        cpu_engine=1.5,
        cpu_train=1.8,
        cpu_driver_s=0.1,
    )
    # E_ref = 0.2 s at 1.5 cores, U_ref = 0.3 s at 1.8 cores, 0.1 s driver: 0.94 CPU-s over 2 cores
    assert pm.cpu_bound_step(0.2, 0.3, 0.02, 0.01, k) == pytest.approx(0.01 + 0.02 + (0.3 + 0.54 + 0.1) / 2)
    no_counts = pm.Costs(**{**k.__dict__, "cpu_engine": 0.0, "cpu_train": 0.0})
    assert pm.cpu_bound_step(0.2, 0.3, 0.02, 0.01, no_counts) == 0.0  # an old trace: no bound


def test_rounds_hand_computed():
    groups = [[3, 4], [10, 2], [5, 5], [20, 1]]
    r = pm.sync_round(groups)
    assert (r.iterations, r.tokens, r.rows, r.max_len) == (20, 50, 8, 20)
    assert pm.round_engine_s(r.iterations, r.tokens, a=0.01, c=0.001) == pytest.approx(0.2 + 0.05)
    assert pm.replica_engine_s(20, 50, 0.01, 0.001, replicas=2) == pytest.approx(0.2 + 0.025)
    # τ = 8, B = 2: short groups (max ≤ 8) end at 4 and 5; the round stops at 5 and the two
    # unfinished groups are cut to the long queue
    rnd, cut, kept = pm.short_round(groups, B=2, tau=8)
    assert (rnd.iterations, rnd.tokens, rnd.rows, rnd.max_len, kept) == (5, 30, 4, 5, 2)
    assert cut == [[10, 2], [20, 1]]
    # τ = 4: only [3, 4] is short, so the round runs to τ; the three others reached τ: cut
    rnd, cut, kept = pm.short_round(groups, B=2, tau=4)
    assert (rnd.iterations, rnd.tokens, kept, rnd.cut_groups) == (4, 3 + 4 + 4 + 2 + 4 + 4 + 4 + 1, 1, 3)
    assert cut == [[10, 2], [5, 5], [20, 1]]
    # a refill takes a cut group's slot at τ: [10, 2] is cut at 4, [2, 2] runs 4..6 and completes B = 2
    rnd, cut, kept = pm.short_round([[3, 4], [10, 2]], B=2, tau=4, refill=iter([[2, 2]]))
    assert (rnd.iterations, rnd.tokens, rnd.rows, rnd.max_len, cut, kept) == (6, 7 + 6 + 4, 4, 4, [[10, 2]], 2)
    assert pm.train_s(8, 26.0, 0.5, 0.01) == pytest.approx(0.5 + 0.01 * 8 * 26)


def test_simulate_tail_infinite_threshold_is_plain_rounds_and_long_rounds_drain_the_queue():
    groups = [[3, 4], [10, 2], [5, 5], [20, 1]]
    plain = pm.simulate_tail(groups, B=2, s=pm.Setting(tail=True), rounds=50)
    assert not any(r.long for r in plain) and all(r.rows == 4 for r in plain)
    s = pm.Setting(tail=True, tail_threshold=6, tail_overprovision=2.0)
    rounds = pm.simulate_tail(groups, B=2, s=s, rounds=200, seed=1)
    longs = [r for r in rounds if r.long]
    # long rounds run B = 2 queued groups whole (iterations = their longest response, here past τ)
    assert longs and all(r.rows == 4 and r.iterations == r.max_len for r in longs)
    assert any(r.iterations == 20 for r in longs)
    assert all(r.max_len <= 6 for r in rounds if not r.long)  # short rounds train nothing past τ
    # every cut group runs in exactly one long round or is still queued at the end (a short
    # round adds at most its 4 launched groups to a queue that is drained once it holds B = 2)
    assert sum(r.cut_groups for r in rounds) - 2 * len(longs) in range(2 + 4)


# ---- fit and predict on a synthetic run ---------------------------------------------------------

A, C, U1, UPD, OTHER, G0 = 0.004, 0.0005, 2e-5, 0.05, 0.02, 0.03


def _synthetic_run(tmp_path: Path, steps: int = 12, B: int = 4, n: int = 2) -> Path:
    """A run dir whose numbers follow the model exactly (sync, 2 cores, prompt length 6)."""
    d = tmp_path / "run"
    d.mkdir()
    metrics, ledger = [], []
    for t in range(steps):
        lens = [[5 + (t * 7 + g * 3 + i * 5) % 30 for i in range(n)] for g in range(B)]
        flat = [x for g in lens for x in g]
        busy = A * max(flat) + C * sum(flat)
        train = U1 * len(flat) * (6 + max(flat))
        metrics.append(
            {
                "step": t + 1,
                "time/step": OTHER + busy + G0 + train + UPD,
                "time/get_batch": busy + G0,
                "time/train": train,
                "time/push_weights": UPD,
                "rollout/busy_s": busy,
                "rollout/decode_steps": max(flat),
                "rollout/tokens_generated": sum(flat),
            }
        )
        ledger += [
            {"prompt_id": t * B + g, "step": t, "outcome": "trained", "len": x, "plen": 6}
            for g, gl in enumerate(lens)
            for x in gl
        ]
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (d / "ledger.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ledger))
    (d / "config.yaml").write_text(
        f"async_ratio: 0.0\ntrain:\n  prompts_per_step: {B}\nresources:\n"
        f"  engine_threads: 0\n  trainer_threads: 0\nray:\n  num_cpus: 2\n"
    )
    (d / "summary.json").write_text(json.dumps({"threads": {"engine": 2, "trainer": 2}, "cores": 2}))
    return d


def test_fit_recovers_the_costs_and_predicts_hand_computed_settings(tmp_path):
    trace = planner.load_trace(_synthetic_run(tmp_path))
    k = trace.costs
    assert (k.a, k.c, k.u1) == (pytest.approx(A), pytest.approx(C), pytest.approx(U1))
    assert (k.update_s, k.other_s, k.g0, k.prompt_len) == (
        pytest.approx(UPD),
        pytest.approx(OTHER),
        pytest.approx(G0),
        6.0,
    )
    own = planner.predict(trace, trace.setting).step_s
    assert own == pytest.approx(trace.measured_step_s, rel=0.05)  # mean vs median of the same steps
    # r = 1 at the same threads (2 + 2 on 2 cores overlapped: both roles 2x slower): per step
    # T = O + max(U' + W, E' + g0) with E' = 2E, U' = 2U
    p = {"engine": 0.0, "trainer": 0.0}
    s = pm.Setting(async_ratio=1.0, engine_threads=2, trainer_threads=2)
    want = sum(
        OTHER
        + max(
            2 * U1 * sum(map(len, st)) * (6 + max(map(max, st))) + UPD,
            2 * (A * max(map(max, st)) + C * sum(map(sum, st))) + G0,
        )
        for st in trace.steps
    )
    assert planner.predict(trace, s, p).step_s == pytest.approx(want / len(trace.steps))


def test_plan_candidates_are_strict(tmp_path):
    d = str(_synthetic_run(tmp_path))
    with pytest.raises(ConfigError, match="did you mean 'async_ratio'"):
        planner.plan(d, ["asyn_ratio=0,1"], out=lambda _: None)
    with pytest.raises(ConfigError, match="add rollout.scheduler=tail_batching"):
        planner.plan(d, ["rollout.tail_batching.threshold=10"], out=lambda _: None)
    with pytest.raises(ConfigError, match="did you mean 'tail_batching'"):
        planner.plan(d, ["rollout.scheduler=tail_batchin"], out=lambda _: None)
    with pytest.raises(ConfigError, match="must be a finite number >= 0"):
        planner.plan(d, ["async_ratio=-1"], out=lambda _: None)
    lines: list[str] = []
    rows = planner.plan(
        d,
        ["async_ratio=0,1,2", "rollout.scheduler=plain,tail_batching", "rollout.tail_batching.threshold=p50,inf"],
        out=lines.append,
    )
    assert len(rows) == 9  # plain once per ratio (its tail knobs are '-'), tail at p50 and inf
    inf = {
        r["settings"]["async_ratio"]: r["predicted_s_per_step"]
        for r in rows
        if r["settings"]["rollout.tail_batching.threshold"] == "inf"
    }
    plain = {
        r["settings"]["async_ratio"]: r["predicted_s_per_step"]
        for r in rows
        if r["settings"]["rollout.scheduler"] == "plain"
    }
    # τ = ∞ cuts nothing; with the default over-provisioning 1.25 it still launches extra groups,
    # so it is never faster than plain
    assert all(inf[r] >= plain[r] * 0.98 for r in plain)
    assert rows == sorted(rows, key=lambda r: r["predicted_s_per_step"])
    assert json.loads(lines[-1])["candidates"] == rows  # the last line is the JSON
    rows = [r for r in rows if r["settings"]["rollout.tail_batching.threshold"] != "inf"]
    tail = [r for r in rows if r["settings"]["rollout.scheduler"] == "tail_batching"]
    assert all(r["long_rounds"] > 0 for r in tail)


def test_old_run_without_lengths_is_a_named_error(tmp_path):
    d = _synthetic_run(tmp_path)
    (d / "ledger.jsonl").write_text(json.dumps({"prompt_id": 0, "step": 0, "outcome": "trained"}) + "\n")
    with pytest.raises(ConfigError, match="predates `flash plan`"):
        planner.load_trace(d)


# ---- validation on recorded traces of the default recipe ----------------------------------------

MANIFEST = DATA / "traces.json"


@pytest.mark.skipif(not MANIFEST.is_file(), reason="recorded traces not present")
def test_predictions_from_the_sync_trace_against_measured_runs():
    """tests/data/planner: trimmed traces of the default recipe's synchronous runs and the measured
    seconds per step of every setting (async_ratio 0, 1, 2; tail batching off and on), recorded by
    `python -m bench.planner --repeats 3 --save-traces` on a quiet machine (the command and the
    numbers are in BENCHMARKS.md). Every setting is predicted from the synchronous traces
    alone (three repeats, pooled) with the default parallel fraction: nothing is fitted on the
    settings it predicts. The bar (the issue's): each within 15% of its measured mean."""
    manifest = json.loads(MANIFEST.read_text())
    base = planner.load_trace([DATA / d for d in manifest["base"]])
    assert base.setting.async_ratio == 0.0 and base.costs.cpu_engine > 0 and base.costs.cpu_train > 0
    own = planner.predict(base, base.setting).step_s
    assert own == pytest.approx(base.measured_step_s, rel=0.05)  # the fit reproduces its own runs
    errors = {}
    for e in manifest["settings"]:
        pred = planner.predict(base, planner.parse_candidates(e["overrides"], base)[0][1]).step_s
        errors[" ".join(e["overrides"])] = round(pred / statistics.fmean(e["measured_s_per_step"]) - 1, 3)
    assert len(errors) == 5 and all(abs(err) <= 0.15 for err in errors.values()), errors


@pytest.mark.skipif(not MANIFEST.is_file(), reason="recorded traces not present")
def test_the_cpu_bound_is_what_brings_tail_batching_at_r2_within_the_bar():
    """Why the runs count CPU seconds: a synchronous trace shows each role alone; overlapped at
    r = 2 they share the 2 cores with the driver, and tail batching's extra decoded tokens make
    that bind. Without the CPU counts the recorded tail r = 2 runs are mispredicted by > 15%."""
    manifest = json.loads(MANIFEST.read_text())
    base = planner.load_trace([DATA / d for d in manifest["base"]])
    blind = dataclasses.replace(base, costs=dataclasses.replace(base.costs, cpu_engine=0.0, cpu_train=0.0))
    entry = next(
        e for e in manifest["settings"] if e["overrides"] == ["async_ratio=2", "rollout.scheduler=tail_batching"]
    )
    measured = statistics.fmean(entry["measured_s_per_step"])
    setting = planner.parse_candidates(entry["overrides"], base)[0][1]
    assert planner.predict(blind, setting).step_s < 0.85 * measured
    assert abs(planner.predict(base, setting).step_s / measured - 1) <= 0.15
    sync = planner.parse_candidates(["async_ratio=0"], base)[0][1]  # no overlap: the bound never applies
    assert planner.predict(blind, sync).step_s == planner.predict(base, sync).step_s


@pytest.mark.skipif(not MANIFEST.is_file(), reason="recorded traces not present")
def test_calibration_reproduces_the_calibrating_run():
    manifest = json.loads(MANIFEST.read_text())
    base = planner.load_trace([DATA / d for d in manifest["base"]])
    calib = next(e for e in manifest["settings"] if e["calibrates"])
    setting = planner.parse_candidates(calib["overrides"], base)[0][1]
    measured = statistics.fmean(calib["measured_s_per_step"])
    q = planner.calibrate_p(base, setting, measured)
    assert planner.predict(base, setting, {"engine": q, "trainer": q}).step_s == pytest.approx(measured, rel=0.02)
    with pytest.raises(ConfigError, match="another thread split"):
        planner.calibrate_p(base, base.setting, measured)


def test_cli_plan_prints_a_table_and_json_and_rejects_bad_keys(tmp_path, capsys):
    from flash.app.cli import main

    d = str(_synthetic_run(tmp_path))
    assert main(["plan", d, "async_ratio=0,1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert [r["settings"]["async_ratio"] for r in result["candidates"]] == ["1", "0"]  # fastest first
    assert result["run_dirs"] == [d] and out[1].split()[:3] == ["#", "async_ratio", "s/step"]
    assert main(["plan", d, "asyn_ratio=1"]) == 2
    assert "did you mean 'async_ratio'" in capsys.readouterr().err
    assert main(["plan", "async_ratio=1"]) == 2  # no run dir


@pytest.mark.parametrize(
    "config", [bytes(range(128, 256)), b"seed: !!python/object/apply:os.system ['true']\n", b"- 1\n"]
)
@pytest.mark.parametrize("finished", [False, True])
def test_a_run_dir_whose_config_is_not_a_runs_is_one_line(tmp_path, capsys, config, finished):
    """``flash plan`` reads the run's config.yaml as data: a file flash did not write was a traceback."""
    from flash.app.cli import main

    (tmp_path / "config.yaml").write_bytes(config)
    for name in ("metrics.jsonl", "ledger.jsonl", "summary.json") if finished else ():
        (tmp_path / name).write_text("{}\n")
    assert main(["plan", str(tmp_path), "async_ratio=0,1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "config.yaml" in err
