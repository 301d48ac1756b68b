"""One held-out number: the evaluation sets (named ones, then the task's own as ``eval``), the
headline accuracy (the first set's mean@n), the curve's best step in ``summary.json``, and progress
lines that show only the current phase's figures."""

import io
import json

import pytest

from flash.app.config import load_config
from flash.app.evaluation import OWN_SET, build_eval_sets, headline, set_figures, set_metrics
from flash.app.summary import eval_record
from flash.app.progress import Heartbeat
from flash.recipes.tasks import make_task


def _rows(n):
    return [{"question": f"what is {a} plus 1?", "answer": str(a + 1)} for a in range(n)]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_the_task_s_own_held_out_set_is_one_more_set_after_the_named_ones(tmp_path):
    dev = _jsonl(tmp_path / "dev.jsonl", _rows(6))
    cfg = load_config(
        "recipes/stutter.yaml", [f"eval.sets={{dev: {dev}}}", "data.prompt_key=question", "task.eval_size=5"]
    )
    task = make_task("stutter", eval_size=5)
    sets = build_eval_sets(cfg, task)
    assert [s.name for s in sets] == ["dev", OWN_SET]
    assert len(sets[0].items) == 6 and len(sets[1].items) == 5 and sets[1].rescore is None
    assert [s.name for s in build_eval_sets(cfg)] == ["dev"]  # no task: the named sets only
    # a named set called 'eval' is the user's own choice of it
    cfg = load_config("recipes/stutter.yaml", [f"eval.sets={{eval: {dev}}}", "data.prompt_key=question"])
    assert [(s.name, len(s.items)) for s in build_eval_sets(cfg, task)] == [("eval", 6)]
    # without named sets the task's held-out set is the evaluation
    cfg = load_config("recipes/stutter.yaml", ["task.eval_size=5"])
    assert [(s.name, len(s.items)) for s in build_eval_sets(cfg, task)] == [("eval", 5)]


def test_a_named_set_reading_data_eval_s_files_is_not_evaluated_twice(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", _rows(20))
    dev = _jsonl(tmp_path / "dev.jsonl", _rows(7))
    over = [f"data.train=[{train}]", f"data.eval=[{dev}]", "data.prompt_key=question", "sft.steps=0"]
    cfg = load_config("recipes/math.yaml", over + [f"eval.sets={{gsm_dev: {dev}}}"])
    task = make_task("dataset", train=(train,), eval=(dev,), prompt_key="question")
    assert [(s.name, len(s.items)) for s in build_eval_sets(cfg, task)] == [("gsm_dev", 7)]
    cfg = load_config("recipes/math.yaml", over)
    assert [(s.name, len(s.items)) for s in build_eval_sets(cfg, task)] == [("eval", 7)]


def test_the_headline_is_the_first_set_s_mean_at_n_and_the_figures_name_every_set():
    m = {
        **set_metrics("dev", [[1.0, 0.0], [1.0, 1.0]], [3, 4, 5, 6]),
        **set_metrics("eval", [[0.0, 0.0], [1.0, 0.0]], [3, 4, 5, 6]),
    }
    sets = build_eval_sets.__globals__["EvalSet"]
    assert headline(m, [sets("dev", [], None), sets("eval", [], None)], 2) == pytest.approx(0.75)
    assert headline(m, [sets("eval", [], None)], 2) == pytest.approx(0.25)
    assert headline(m, [], 2) is None
    assert set_figures(m, 2) == "dev mean@2 0.750 pass@2 1.000, eval mean@2 0.250 pass@2 0.500"


def _line(step, acc, dev):
    return {
        "tag": "x",
        "step": step,
        "accuracy": acc,
        "sets": {"eval/eval/mean@4": acc, "eval/eval/pass@4": 1.0, "eval/dev/mean@4": dev},
    }


def test_the_summary_keeps_each_set_at_start_and_end_and_the_best_step_of_the_curve():
    evals = [_line(0, 0.2, 0.1), _line(10, 0.5, 0.3), _line(20, 0.6, 0.4), _line(30, 0.6, 0.2), _line(40, 0.45, 0.5)]
    rec = eval_record(evals)
    assert rec["eval_sets_initial"] == {"eval": {"mean@4": 0.2, "pass@4": 1.0}, "dev": {"mean@4": 0.1}}
    assert rec["eval_sets_final"]["eval"]["mean@4"] == 0.45 and rec["eval_sets_final"]["dev"]["mean@4"] == 0.5
    assert (rec["eval_accuracy_best"], rec["eval_best_step"]) == (0.6, 20)  # the earliest of equals, not the final
    only = eval_record(evals[:1])
    assert only["eval_accuracy_best"] is None and only["eval_sets_final"] == {}
    assert eval_record([])["eval_sets_initial"] == {}


def test_a_new_phase_shows_no_figure_from_the_phase_before():
    hb = Heartbeat(0, enabled=False, stream=io.StringIO())
    hb.set(phase="train", step=30, total=30, reward=0.383, accuracy="0.125@20", detail="eval 8/16 samples, ~2s left")
    assert hb.line().endswith(
        "train step 30/30 (elapsed 0s, ~0s left) reward 0.383 accuracy 0.125@20 eval 8/16 samples, ~2s left"
    ), hb.line()
    hb.set(phase="evaluation after training")
    assert hb.line().endswith("] evaluation after training"), hb.line()


def test_a_sweep_row_takes_the_best_accuracy_and_its_step_from_the_curve(tmp_path):
    from flash.app.sweep import Point, collect

    summary = {
        "train_seconds": 10.0,
        "seconds_per_step": 2.5,
        "wall_seconds": 20.0,
        "samples_trained": 64,
        "async_ratio": 0.0,
        "eval_accuracy_initial": 0.2,
        "eval_accuracy_final": 0.45,
        "max_staleness_observed": 0.0,
        "steps": 40,
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "time/step": 1.0}) + "\n" for s in (1, 2)))
    evals = [_line(0, 0.2, 0.1), _line(10, 0.5, 0.3), _line(20, 0.6, 0.4), _line(30, 0.6, 0.2), _line(40, 0.45, 0.5)]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    row = collect(Point({"async_ratio": "0"}, []), tmp_path)
    assert (row["acc_final"], row["acc_best"], row["acc_best_step"]) == (0.45, 0.6, 20)
