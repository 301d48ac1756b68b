"""`flash plan` on simulated runs (flash.app.plan_sim, flash.app.plan_sim_model): the model's pure
functions, the out-of-sample check on a recorded trace, and its errors.

tests/data/plan_sim holds trimmed traces of `flash run sim_rlvr` at 64 simulated GPUs, synchronous
(``base``) and at async ratio 2 (``base-r2``), and the simulated seconds per step measured at other
scales and ratios (``targets.json``), all written by ``python -m bench.sim_plan --save-traces
tests/data/plan_sim`` on a quiet machine (load average 2-4).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from flash.app import plan_sim as ps
from flash.app import plan_sim_model as sm
from flash.errors import ConfigError
from flash.sim import cost as costs
from flash.sim.cost import preset

DATA = Path(__file__).parents[1] / "data" / "plan_sim"
SHAPE = sm.Shape(preset("qwen2.5-7b-h100"), n=2, token_scale=256, prompt_tokens=512.0, max_num_seqs=64)


@pytest.fixture(scope="module")
def trace() -> ps.SimTrace:
    return ps.load_sim_trace(DATA / "base")


# ---- pure functions ---------------------------------------------------------------------------
def test_instances_follow_tp():
    assert sm.instances(SHAPE, 64) == 64
    assert sm.instances(sm.Shape(preset("qwen2.5-32b-h100"), 8, 1, 0.0, 64), 64) == 16
    assert sm.instances(SHAPE, 0) == 1


def test_decode_cost_depends_on_the_per_instance_load_only():
    """Twice the sequences on twice the instances: the same step; twice on the same: dearer."""
    one = sm.decode_s(SHAPE, 32, 512, 512 * 2000.0)
    assert sm.decode_s(SHAPE, 64, 1024, 1024 * 2000.0) == pytest.approx(one)
    assert sm.decode_s(SHAPE, 32, 1024, 1024 * 2000.0) > one * 1.05
    assert one == pytest.approx(costs.decode_run_s(SHAPE.cm, 16, 16 * 2000.0, 256))
    assert sm.decode_s(SHAPE, 32, 0, 0.0) == 0.0


def test_trainer_scales_with_tokens_over_gpus():
    k = sm.SimCosts(train_factor=1.5)
    assert sm.train_s(SHAPE, 2e6, 64, k) == pytest.approx(sm.train_s(SHAPE, 1e6, 32, k))
    assert sm.train_s(SHAPE, 1e6, 32, k) == pytest.approx(1.5 * costs.train_step_s(SHAPE.cm, 1e6, 32))
    assert sm.group_tokens(SHAPE, [1, 3]) == 2 * 512 + 256 * 4


def test_admission_limit_is_the_staleness_bound():
    assert sm.admission_limit(0, 0.0, 64) == 64
    assert sm.admission_limit(0, 2.0, 64) == 192
    assert sm.admission_limit(3, 0.5, 10) == 45


def test_sync_round_is_the_sum_of_its_engine_steps_and_phases():
    """B = 1 group of lengths (2, 1) ids on one instance: prefill + decode of 2, then of 1; then
    driver, train and push in series."""
    k = sm.SimCosts(engine_factor=1.1, train_factor=1.0, push_s=1.0, driver_per_row_s=0.25)
    out = sm.simulate(iter([[2, 1]] * 4), SHAPE, sm.Scale(1, 8, 1, 0.0), k, steps=2)
    p = SHAPE.prompt_tokens
    engine = 1.1 * (
        costs.prefill_s(SHAPE.cm, 2 * p)
        + costs.decode_run_s(SHAPE.cm, 2, 2 * p, 256)
        + costs.decode_run_s(SHAPE.cm, 1, p + 256, 256)
    )
    train = costs.train_step_s(SHAPE.cm, 2 * p + 3 * 256, 8)
    assert out.engine_s == pytest.approx([engine, engine])
    assert out.step_s == pytest.approx([engine + 0.5 + train + 1.0] * 2)


def test_async_hides_the_tail_but_not_the_trainer():
    """Long-tailed groups: r = 2 keeps the engine full past each batch's longest response, so a
    step is shorter than the synchronous one, and no shorter than train + push."""
    groups = [[32, 2], [3, 2], [4, 1], [2, 2]] * 50
    k = sm.SimCosts(push_s=1.0)
    scale = sm.Scale(4, 4, 8, 0.0)
    sync = sm.simulate(iter(groups), SHAPE, scale, k, 10)
    fast = sm.simulate(iter(groups), SHAPE, sm.Scale(4, 4, 8, 2.0), k, 10)
    mean = lambda xs: sum(xs[3:]) / len(xs[3:])
    assert mean(fast.step_s) < 0.8 * mean(sync.step_s)
    assert mean(fast.step_s) >= mean(fast.train_s) + 1.0 - 1e-9


def test_a_due_group_holds_the_batch():
    eng = sm.EngineState(SHAPE, sm.Scale(1, 1, 1, 1.0), sm.SimCosts())
    eng.finished = [sm._Group(1, [1]), sm._Group(1, [1])]
    eng.live = [sm._Group(0, [5])]
    assert not sm.batch_ready(eng, step=1, B=1, r=1.0)  # admitted at version 0: due at step 1
    assert sm.batch_ready(eng, step=0, B=1, r=1.0)
    assert [g.version for g in sm.take_batch(eng, 1)] == [1]


# ---- the recorded trace: out of sample across scale -------------------------------------------
def test_trace_is_read_in_simulated_seconds(trace):
    assert trace.scale == sm.Scale(32, 32, 64, 0.0)
    assert 75 < trace.measured_step_s < 90  # simulated seconds; the wall step was ~4 s
    assert 0.9 < trace.costs.engine_factor < 1.1 and 0.9 < trace.costs.train_factor < 1.2
    assert 0.9 < trace.costs.push_s < 2.0
    own = ps.predict_sim(trace, trace.scale)["step_s"]
    assert own == pytest.approx(trace.measured_step_s, rel=0.03)


def test_predictions_at_other_scales_match_the_recorded_runs(trace):
    """Every target (other GPUs, batch and ratio) predicted within 10% of its measured run, by the
    mean of ``sim/step_s`` and by the time counted over one contiguous interval (bench/sim_plan.py)."""
    targets = json.loads((DATA / "targets.json").read_text())["targets"]
    assert len(targets) >= 4
    for t in targets:
        gpus, ratio, prompts = _setting(t["setting"])
        scale = sm.Scale(gpus // 2, gpus - gpus // 2, prompts, ratio)
        pred = ps.predict_sim(trace, scale, t["steps"])["step_s"]
        assert pred == pytest.approx(t["predicted_sim_s"], rel=0.01), t  # the model did not drift
        assert abs(pred / t["measured_sim_s"] - 1) < 0.1, (t, pred)
        assert abs(pred / t["measured_contiguous_sim_s"] - 1) < 0.1, (t, pred)


def _setting(text: str) -> tuple[int, float, int]:
    parts = text.split(":")
    return int(parts[0]), float(parts[1]), int(parts[2]) if len(parts) > 2 else int(parts[0])


def test_plan_prints_simulated_seconds_and_ranks(trace):
    lines: list[str] = []
    rows = ps.plan_sim(DATA / "base", ["async_ratio=0,2", "sim.rollout_gpus=32"], out=lines.append)
    assert "SIMULATED seconds" in lines[0] and "no thread terms" in lines[0]
    last = json.loads(lines[-1])
    assert last["units"] == "simulated seconds"
    assert [r["settings"]["async_ratio"] for r in rows] == ["2", "0"]
    assert rows[0]["predicted_sim_s_per_step"] < 0.6 * rows[1]["predicted_sim_s_per_step"]


@pytest.mark.parametrize(
    "item, words",
    [
        ("resources.engine_threads=2", "unknown plan key 'resources.engine_threads'"),
        ("sim.rollout_gpu=64", "did you mean 'sim.rollout_gpus'"),
        ("sim.train_gpus=0", "'sim.train_gpus' must be a finite number >= 1"),
        ("train.prompts_per_step=many", "invalid value 'many'"),
        ("async_ratio=inf", "'async_ratio' must be a finite number"),
    ],
)
def test_bad_scale_keys_are_one_line_errors(trace, item, words):
    with pytest.raises(ConfigError) as err:
        ps.parse_scales([item], trace)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_real_run_is_not_planned_as_simulated():
    assert not ps.is_sim_run(Path(__file__).parents[1] / "data" / "planner" / "base-0")
    assert ps.is_sim_run(DATA / "base")
    assert ps.sim_skip(0) == 1 and ps.sim_skip(2) == 3 and ps.sim_skip(0.5) == 2
    assert math.isfinite(ps.measured_sim_step_s(DATA / "base"))


def test_cli_plans_a_simulated_run_and_rejects_thread_options(capsys):
    from flash.app.cli import main

    assert main(["plan", str(DATA / "base"), "sim.rollout_gpus=64", "train.prompts_per_step=128"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1])["units"] == "simulated seconds" and "sim s/step" in out[1]
    assert main(["plan", str(DATA / "base"), "async_ratio=1", "--calibrate", str(DATA / "base")]) == 2
    assert "no --calibrate" in capsys.readouterr().err
    assert main(["plan", str(DATA / "base"), "resources.trainer_threads=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown plan key 'resources.trainer_threads' for a simulated run" in err and len(err.splitlines()) == 1


def test_an_async_trace_plans_the_synchronous_run_and_larger_scales(trace):
    """The 64-GPU r = 2 run of the same bench as the base (``base-r2``) predicts the synchronous
    base run and the 256-GPU async target within 20% of their measured simulated seconds."""
    fast = ps.load_sim_trace(DATA / "base-r2")
    assert fast.scale == sm.Scale(32, 32, 64, 2.0)
    assert 0.9 < fast.costs.engine_factor < 1.15
    sync = ps.predict_sim(fast, replace(fast.scale, async_ratio=0.0), steps=6)["step_s"]
    assert abs(sync / trace.measured_step_s - 1) < 0.1
    target = next(t for t in json.loads((DATA / "targets.json").read_text())["targets"] if t["setting"] == "256:2")
    big = ps.predict_sim(fast, sm.Scale(128, 128, 256, 2.0), steps=target["steps"])["step_s"]
    assert abs(big / target["measured_sim_s"] - 1) < 0.2


def test_contiguous_count_keeps_engine_work_between_steps(tmp_path):
    """bench/sim_plan.py's contiguous measure: the engine decodes from 10.0 to 11.0 (wall), the last
    step's phases run 10.5 to 12.0 with the trainer busy from 11.5. Over [10, 12] at time scale 0.1
    that is 1.5 s of GPU time (15 simulated) and 0.5 s of neither; the step's own window misses the
    engine's first half second."""
    from bench.sim_plan import contiguous_sim_step_s
    from flash.sim.accounting import simulated_step_s

    (tmp_path / "config.yaml").write_text("async_ratio: 2\nsim:\n  time_scale: 0.1\n")
    last = {"step": 4, "phases": {"get_batch": [10.5, 11.5], "train": [11.5, 12.0]}, "engine_busy": [[10.0, 11.0]]}
    rows = [{"step": s, "phases": {"get_batch": [s * 3.0, s * 3.0 + 1]}, "engine_busy": []} for s in (1, 2)]
    rows += [{"step": 3, "phases": {"train": [9.0, 10.0]}, "engine_busy": []}, last]
    (tmp_path / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert contiguous_sim_step_s(tmp_path) == pytest.approx(15.5)
    assert simulated_step_s(1.5, last, 0.1)[0] == pytest.approx(10.5)


def test_an_episode_run_is_refused_by_name(tmp_path):
    """Multi-turn episodes (turns, environment latency) are outside the model: one line, not a wrong plan."""
    import shutil

    from flash.errors import ConfigError

    run = tmp_path / "episodes"
    shutil.copytree(DATA / "base", run)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("".join(json.dumps({**r, "rollout/episodes/turns": 40.0}) + "\n" for r in rows))
    with pytest.raises(ConfigError, match="multi-turn episode run; flash plan models single-turn"):
        ps.load_sim_trace(run)
