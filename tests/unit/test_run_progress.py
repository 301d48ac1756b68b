"""What a run says while it runs (flash.app.progress): the accuracy marked with the step it was
measured at, the no-update line, an evaluation's count and time left, an ETA that settles before it
is given, the whole prompt in the eval records, and a resumed run's bar and wall time."""

import io
import json
from types import SimpleNamespace

import pytest

from flash.app.evaluation import EvalSet, evaluate_sets
from flash.app.progress import (
    Heartbeat,
    Progress,
    TrainEta,
    eval_note,
    evals_left,
    no_update_note,
    settle_steps,
    step_eta,
    time_note,
)
from flash.tasks import TaskItem


def _progress(**kwargs) -> tuple[Progress, Heartbeat, list[str]]:
    hb = Heartbeat(0, enabled=False, stream=io.StringIO())
    progress = Progress(20, False, hb, **kwargs)
    written: list[str] = []
    progress.write = written.append  # type: ignore[method-assign]
    return progress, hb, written


def test_train_lines_mark_the_accuracy_with_its_step_and_leave_it_out_without_periodic_evaluation():
    progress, hb, _ = _progress(accuracy=(0.284, 0))
    progress.update({"step": 3, "reward/mean": 0.5, "time/elapsed": 30.0})
    assert hb.line().endswith("train step 3/20 (elapsed 30s, ETA settling) reward 0.500 accuracy 0.284@0"), hb.line()
    progress.update({"step": 4, "reward/mean": 0.25, "time/elapsed": 50.0, "eval/accuracy": 0.3125, "time/eval": 8.0})
    progress.update({"step": 5, "reward/mean": 0.25, "time/elapsed": 60.0})
    assert hb.line().endswith("reward 0.250 accuracy 0.312@4"), hb.line()
    # no periodic evaluation: the before-training figure is not repeated as if current
    quiet, hb, _ = _progress(accuracy=None)
    quiet.update({"step": 3, "reward/mean": 0.5, "time/elapsed": 30.0, "eval/accuracy": 0.5})
    assert "accuracy" not in hb.line() and hb.line().endswith("reward 0.500"), hb.line()


def test_a_step_with_every_advantage_zero_says_no_update_once_per_streak_step_then_at_powers_of_ten():
    progress, _, written = _progress()
    flags = [1, 1, 0, 1] + [1] * 120
    for i, flag in enumerate(flags, start=1):
        progress.update({"step": i, "train/no_update": float(flag), "train/grad_norm": 0.0})
    assert written == [
        "flash: step 1: no update: all groups had equal reward (every advantage 0)",
        "flash: step 4: no update: all groups had equal reward (every advantage 0)",
        "flash: step 13: no update: all groups had equal reward (every advantage 0) (10 steps in a row)",
        "flash: step 103: no update: all groups had equal reward (every advantage 0) (100 steps in a row)",
    ]
    assert no_update_note(7, 1, 0.5).endswith("(every advantage 0); only the loss's KL/entropy terms trained")
    assert [no_update_note(9, k, 0.0) is None for k in (3, 9, 11, 99, 1000)] == [True, True, True, True, False]


def test_a_resumed_run_goes_on_with_the_no_update_streak_its_metrics_log_ends_with(tmp_path):
    """A streak that began before the interrupt is neither announced again nor restarted: steps 2-10
    had every advantage 0, the run resumes at step 10, and step 11 is the streak's 10th step."""
    from flash.app.summary import logged_no_update_streak

    lines = [{"step": 1, "train/no_update": 0.0}] + [{"step": s, "train/no_update": 1.0} for s in range(2, 11)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    assert logged_no_update_streak(tmp_path) == 9
    progress, _, written = _progress(start=10, streak=logged_no_update_streak(tmp_path))
    for step in (11, 12):
        progress.update({"step": step, "train/no_update": 1.0, "train/grad_norm": 0.0})
    assert written == ["flash: step 11: no update: all groups had equal reward (every advantage 0) (10 steps in a row)"]
    # a streak the last logged step ended, a step without the key, no log, a log edited by hand: 0
    for tail in ([{"step": 11, "train/no_update": 0.0}], [{"step": 11}], [{"step": 11, "train/no_update": "x"}]):
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines + tail))
        assert logged_no_update_streak(tmp_path) == 0, tail
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train/no_update": 1.0}\nnot json\n')
    assert logged_no_update_streak(tmp_path) == 0 and logged_no_update_streak(tmp_path / "none") == 0


def test_an_evaluation_reports_its_samples_done_and_time_left_then_its_scoring_count(tmp_path, monkeypatch):
    import flash.app.evaluation as ev

    clock = iter([100.0, 104.0, 110.0, 112.0, 114.0, 115.0, 120.0, 126.0, 127.0])
    monkeypatch.setattr(ev, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    sample = SimpleNamespace(response_ids=[1], prompt_ids=[3], reward=1.0, finish_reason="stop")

    def evaluate_samples(items, params, tag, seed, on_progress, on_scored):
        for done in (2, len(items)):
            on_progress(done)
        for done in (3, len(items)):
            on_scored(done)
        return [sample] * len(items)

    sets = [EvalSet("a", [TaskItem(i, "q", "1") for i in range(2)], None), EvalSet("b", [TaskItem(0, "q", "1")], None)]
    notes: list[str] = []
    evaluate_sets(
        SimpleNamespace(evaluate_samples=evaluate_samples),
        sets,
        None,
        4,
        0,
        tmp_path,
        0,
        str,
        decode_prompt=str,
        on_progress=notes.append,
    )
    assert notes == [
        "eval 2/12 samples, ~20s left",  # 4 s for 2: 10 more at 2 s each
        "eval 8/12 samples, scoring 0/8, ~? left",  # set a generated (at 110 s), its scoring starts
        "eval 8/12 samples, scoring 3/8, ~3s left",  # 2 s for 3 of 8: 5 more at 0.67 s
        "eval 8/12 samples, scoring 8/8, ~0s left",
        "eval 10/12 samples, ~3s left",  # 15 s for 10 of all 12
        "eval 12/12 samples, scoring 0/4, ~? left",
        "eval 12/12 samples, scoring 3/4, ~2s left",  # 6 s for 3 of 4
        "eval 12/12 samples, scoring 4/4, ~0s left",
    ]
    assert eval_note(0, 64, 3.0) == "eval 0/64 samples, ~? left"


def test_a_set_scored_by_its_own_reward_in_the_driver_counts_its_scoring_too():
    from flash.app.evaluation import EvalCount, _rescored

    notes: list[str] = []
    count = EvalCount(6, notes.append)
    count.next_set(2)
    count.next_set(4)  # the second set: 2 samples of the first before it
    rewards = _rescored(lambda item, text: len(text), ["i"] * 4, ["a", "bb", "ccc", "x"], count, every_s=0.0)
    assert rewards == [1.0, 2.0, 3.0, 1.0]
    assert [n.rsplit(",", 1)[0] for n in notes] == [f"eval 6/6 samples, scoring {k}/4" for k in range(5)], notes


def test_the_reward_threads_tell_an_evaluation_how_many_of_its_calls_are_done_while_they_run():
    import threading

    from flash.controllers.reward_threads import RewardThreads

    threads = RewardThreads(threading.Condition(), 3, lambda fn: fn)
    release, told = threading.Event(), []
    threading.Timer(0.3, release.set).start()
    try:
        out = threads.map(
            lambda x: x * 2 if x < 2 else release.wait(5) and x * 2, [0, 1, 2], on_done=told.append, every_s=0.02
        )
    finally:
        release.set()
        threads.shutdown()
    assert out == [0, 2, 4] and told[-1] == 3
    assert 2 in told and told == sorted(told), told  # two were done while the third ran


def test_eval_records_hold_the_whole_prompt_not_only_the_system_turn(tmp_path):
    from flash.models import build_tokenizer, decode_response, encode_prompt

    tok = build_tokenizer()
    prompt = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2+3?"}]
    ids = encode_prompt(tok, prompt)
    assert tok.eos_token_id in ids[:-3]  # the system turn ends in the end-of-sequence token
    sample = SimpleNamespace(response_ids=[tok.eos_token_id], prompt_ids=ids, reward=0.0, finish_reason="stop")
    scheduler = SimpleNamespace(evaluate_samples=lambda items, params, tag, seed, **_: [sample] * len(items))
    evaluate_sets(
        scheduler,
        [EvalSet("eval", [TaskItem(0, prompt, "5")], None)],
        None,
        1,
        0,
        tmp_path,
        3,
        lambda x: decode_response(tok, x),
        decode_prompt=tok.decode,
    )
    record = json.loads((tmp_path / "eval/eval/step-3.jsonl").read_text())
    assert "be brief" in record["prompt"] and "what is 2+3?" in record["prompt"], record["prompt"]
    assert "what is 2+3?" not in decode_response(tok, ids)  # a response's decoder stops at the first end of sequence


def test_the_train_eta_settles_through_the_head_start_then_never_grows_at_a_steady_rate():
    assert [settle_steps(r) for r in (0.0, 1.0, 2.5)] == [2, 3, 5]
    assert [evals_left(s, 20, 5) for s in (0, 4, 5, 15, 19, 20)] == [4, 4, 3, 1, 1, 0]
    assert evals_left(3, 20, 0) == 1  # the final evaluation only
    eta = TrainEta(total=20, settle=3, every=5, eval_s=6.0)
    # two steps on the head start's ready batches (1 s), then 10 s steps; step 5 evaluates for 6 s
    elapsed, shown = 0.0, []
    for step in range(1, 9):
        elapsed += (1.0 if step <= 2 else 10.0) + (6.0 if step == 5 else 0.0)
        eta.observe({"time/elapsed": elapsed, **({"time/eval": 6.0} if step == 5 else {})})
        shown.append(eta.left(step))
    assert shown[:2] == [None, None]
    # 10 s per step left, plus the evaluations at 10, 15 and the final one
    assert (
        shown[2:]
        == [10.0 * (20 - s) + 6.0 * evals_left(s, 20, 5) for s in range(3, 9)]
        == [194.0, 184.0, 168.0, 158.0, 148.0, 138.0]
    )
    # the mean rate since the start, over the same steps, grows
    mean_rate = [step_eta(s, 20, 2.0 + 10.0 * (s - 2)) for s in (2, 3, 4)]
    assert mean_rate == ["(elapsed 2s, ~18s left)", "(elapsed 12s, ~1m08s left)", "(elapsed 22s, ~1m28s left)"]
    assert time_note(190.0, None) == "(elapsed 3m10s, ETA settling)"
    assert time_note(190.0, 480.0) == "(elapsed 3m10s, ~8m00s left)"


def test_one_slow_step_does_not_swing_the_eta():
    eta = TrainEta(total=100, settle=2, elapsed0=500.0)  # a resumed run: 500 s before its checkpoint
    elapsed = 500.0
    for seconds in (1.0, 10.0, 10.0, 60.0, 10.0):
        elapsed += seconds
        eta.observe({"time/elapsed": elapsed})
    assert eta.seconds == [1.0, 10.0, 10.0, 60.0, 10.0] and eta.left(55) == 10.0 * 45 + 0.0


def test_a_resumed_run_bar_starts_at_its_step_and_its_wall_time_covers_the_time_before(monkeypatch):
    import sys

    from flash.app.roles import Clock

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    bar = Progress(30, True, start=12)
    try:
        assert (bar.bar.n, bar.bar.total) == (12, 30)
        bar.update({"step": 13, "reward/mean": 0.5, "time/elapsed": 700.0})
        assert bar.bar.n == 13 and str(bar.bar).endswith("| 13/30, reward=0.500, stale=0, elapsed 11m40s, ETA settling")
    finally:
        bar.close()
    clock = Clock(t0=1000.0, wall0=900.0)
    monkeypatch.setattr("flash.app.roles.time.monotonic", lambda: 1100.0)
    assert clock.wall() == pytest.approx(1000.0)


def test_a_resumed_run_summary_totals_count_every_step_of_the_run_once():
    from flash.app.summary import run_totals

    # metrics.jsonl of a run resumed at step 2: steps 1-2 before the interruption, 3-4 after
    lines = [
        {
            "step": s,
            "staleness/max": float(m),
            "staleness/count_0": 6.0,
            "staleness/count_1": float(2 * m),
            "time/train": t,
            "time/step": 2 * t,
        }
        for s, m, t in ((1, 0, 1.0), (2, 1, 3.0), (3, 1, 2.0), (4, 0, 2.0))
    ]
    lines[2]["time/eval"] = 9.0
    totals = run_totals(lines, ["time/step", "time/train"])
    assert totals == {
        "samples_trained": 28,
        "max_staleness_observed": 1.0,
        "phase_seconds_mean": {"step": 4.0, "train": 2.0},
    }
    assert run_totals([], ["time/step"]) == {
        "samples_trained": 0,
        "max_staleness_observed": 0.0,
        "phase_seconds_mean": {"step": 0.0},
    }


def test_between_two_steps_the_heartbeat_counts_the_time_left_down_not_up(monkeypatch):
    import flash.app.progress as pr

    now = [0.0]
    monkeypatch.setattr(pr, "time", SimpleNamespace(monotonic=lambda: now[0]))
    hb = Heartbeat(0, enabled=False, stream=io.StringIO())
    hb.set(phase="warm start")
    now[0] = 20.0
    hb.set(step=5, total=40)  # 4 s a step: 140 s left
    shown = []
    for t in (20.0, 26.0, 30.0):
        now[0] = t
        shown.append(hb.line().split("] ")[1])
    assert shown == [
        "warm start step 5/40 (elapsed 20s, ~2m20s left)",
        "warm start step 5/40 (elapsed 26s, ~2m14s left)",
        "warm start step 5/40 (elapsed 30s, ~2m10s left)",
    ]
    # the train phase: elapsed and left as of the last step, carried on by the time since it
    progress = Progress(20, False, hb, eta=TrainEta(20, 1))
    progress.update({"step": 1, "reward/mean": 0.5, "time/elapsed": 10.0})
    now[0] = 37.0
    assert hb.line().endswith("train step 1/20 (elapsed 17s, ~3m03s left) reward 0.500"), hb.line()
