"""Observability: idle ratios on a controlled case, tracker selection, TensorBoard scalars.

The idle-ratio case drives the real ``EngineLoop`` with a stub engine whose every step sleeps a
known time, and a stub trainer that sleeps a known time, and reads both through the controller's
own ``_role_metrics`` -- the same arithmetic a run uses, with the answer known in advance.
"""

import re
import sys
import time
from types import SimpleNamespace

import pytest

import flash.controllers.async_controller as ac
import flash.engine.client as engine_client
from flash.app.config import load_config
from flash.engine.loop import EngineLoop
from flash.errors import ConfigError
from flash.app.tracking import make_tracker
from flash.usage import IdleMeter, SpanRecorder, busy_fraction

RECIPE = "recipes/stutter.yaml"


class SleepyEngine:
    """Stub engine: one unit of submitted work per step, each step sleeps ``step_s``."""

    def __init__(self, step_s: float):
        self.step_s, self.work = step_s, 0
        self.tokens_generated = self.num_running = self.num_waiting = self.version = 0
        self.asleep = False  # the EngineLoop reports it in stats()

    @property
    def can_step(self) -> bool:
        return self.work > 0

    def add_request(self, units: int) -> None:
        self.work += units

    def step(self):
        time.sleep(self.step_s)
        self.work -= 1
        self.tokens_generated += 1
        return []


class SleepyTrainer:
    def __init__(self):
        self.busy_s = 0.0

    def work(self, seconds: float) -> None:
        start = time.monotonic()
        time.sleep(seconds)
        self.busy_s += time.monotonic() - start

    def stats(self) -> dict:
        return {"busy_s": self.busy_s}


class Handle:
    """Looks like a Ray actor handle (``h.method.remote(...)``) but calls in-process."""

    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name):
        return SimpleNamespace(remote=getattr(self._obj, name))


def test_idle_meter_arithmetic():
    now = [0.0]
    meter = IdleMeter(clock=lambda: now[0])
    assert meter.read(0.0) == 0.0  # first read opens the window
    now[0] = 2.0
    assert meter.read(0.5) == pytest.approx(0.75)  # 0.5 s busy of 2 s
    now[0] = 3.0
    assert meter.read(1.5) == pytest.approx(0.0)  # busy the whole second
    now[0] = 5.0
    assert meter.read(1.5) == pytest.approx(1.0)


def test_span_recorder_merges_close_spans_and_bounds_memory():
    rec = SpanRecorder(gap_s=0.01, max_spans=3)
    for a, b in [(0, 1), (1.005, 2), (3, 4), (5, 6), (7, 8)]:
        rec.add(a, b)
    assert rec.drain() == [[0, 2], [3, 4], [5, 8]]
    assert rec.drain() == []
    assert busy_fraction([[0, 1], [2, 3]], 0.5, 2.5) == pytest.approx(0.5)


def test_idle_ratios_per_role_on_a_controlled_case(monkeypatch):
    """Engine: 10 steps × 30 ms = 0.3 s busy; trainer: 0.25 s busy; window 0.75 s."""
    in_process = SimpleNamespace(get=lambda refs, **_: refs)
    monkeypatch.setattr(ac, "ray", in_process)
    monkeypatch.setattr(engine_client, "ray", in_process)  # the controller's engine calls go through it
    loop = EngineLoop(SleepyEngine(0.03))
    trainer = SleepyTrainer()
    ctrl = ac.AsyncController(
        Handle(loop), Handle(trainer), None, None, None, ac.ControllerSettings(1, "continue", {"name": "grpo"}, False)
    )
    try:
        start = time.monotonic()
        ctrl._start_usage()
        loop.submit([10])
        trainer.work(0.25)
        while loop.stats()["tokens_generated"] < 10:
            time.sleep(0.01)
        time.sleep(max(0.0, 0.75 - (time.monotonic() - start)))
        busy_engine = loop.stats()["busy_s"]
        m = ctrl._role_metrics(step_s=0.75)
        wall = time.monotonic() - start
    finally:
        loop.shutdown()
    # the stub's sleeps, measured by the loop: never less than asked, overshoot bounded (a loaded
    # machine oversleeps each of the ten steps by a few ms)
    assert 0.3 <= busy_engine < 0.45
    assert 0.25 <= trainer.busy_s < 0.35
    # the ratios are the measured busy time over the measured window, whatever the load did to both
    assert m["rollout/idle_ratio"] == pytest.approx(1 - busy_engine / wall, abs=0.02)
    assert m["train/idle_ratio"] == pytest.approx(1 - trainer.busy_s / wall, abs=0.02)
    assert 0.75 <= wall < 1.2  # the window the test held open, not stretched by the reads
    assert 0.3 < m["rollout/idle_ratio"] < 0.7 and 0.5 < m["train/idle_ratio"] < 0.8  # 0.6 and 0.67 unloaded
    assert m["rollout/tokens_generated"] == 10
    spans = ctrl._engine_spans  # the timeline agrees with the counters
    assert sum(b - a for a, b in spans) == pytest.approx(busy_engine, abs=0.03)


def test_tensorboard_holds_the_namespaced_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(RECIPE, ["tracking.backends=[tensorboard]"]).tracking
    tracker = make_tracker(cfg, str(tmp_path))
    metrics = {
        "rollout/idle_ratio": 0.4,
        "train/idle_ratio": 0.6,
        "time/push_weights": 0.01,
        "staleness/max": 1.0,
        "buffer/depth": 3.0,
        "reward/mean": 0.5,
        "eval/accuracy": 0.25,
    }
    for step in (1, 2):
        tracker.log(metrics, step)
    tracker.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert set(metrics) <= set(events.Tags()["scalars"])
    assert [e.value for e in events.Scalars("rollout/idle_ratio")] == pytest.approx([0.4, 0.4])


def test_a_step_keeps_its_best_and_worst_samples_as_text(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from flash.buffers import Group, Sample
    from flash.app.tracking import pick_samples, samples_markdown

    def group(pid, rewards):
        return Group(
            prompt_id=pid,
            samples=[
                Sample(
                    prompt_id=pid,
                    sample_index=k,
                    prompt_ids=[pid],
                    response_ids=[k, 9],
                    behav_logprobs=[0.0, 0.0],
                    versions=[0, 0],
                    reward=r,
                )
                for k, r in enumerate(rewards)
            ],
        )

    decode = lambda ids: "-".join(map(str, ids))  # noqa: E731
    picked = pick_samples(7, [group(1, [0.5, 0.0]), group(2, [1.0, 0.25])], 3, decode)
    assert [(x["prompt_id"], x["sample"], x["reward"]) for x in picked] == [(2, 0, 1.0), (1, 1, 0.0), (1, 0, 0.5)]
    assert picked[0] == {
        "step": 7,
        "prompt_id": 2,
        "sample": 0,
        "reward": 1.0,
        "finish_reason": "",
        "prompt": "2",
        "response": "0-9",
    }
    assert len(pick_samples(1, [group(1, [0.5])], 4, decode)) == 1
    tracker = make_tracker(load_config(RECIPE, ["tracking.backends=[tensorboard]"]).tracking, str(tmp_path))
    tracker.samples("samples", picked, 7)  # TensorBoard has no table: the markdown text
    tracker.close()
    assert samples_markdown(picked).startswith("**prompt 2 sample 0**")
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    events.Reload()
    (event,) = events.Tensors("samples/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 7 and "**prompt 2 sample 0**: reward 1 " in text and "'0-9'" in text


def test_wandb_gets_each_steps_samples_as_a_table(monkeypatch, tmp_path):
    """W&B is an optional extra not installed here: a stand-in module records what our tracker
    hands it (the table's columns and rows are ours to get right)."""
    import types

    from flash.app.tracking import WandbTracker

    logged = []
    fake = types.SimpleNamespace(
        Table=lambda columns, data: ("table", columns, data),
        init=lambda **kw: types.SimpleNamespace(log=lambda d, step: logged.append((d, step)), finish=lambda: None),
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    tracker = WandbTracker("p", "n", str(tmp_path), {})
    rows = [
        {"step": 3, "prompt": "a", "response": "b", "reward": 1.0},
        {"step": 3, "prompt": "c", "response": "d", "reward": 0.0},
    ]
    tracker.samples("samples", rows, 3)
    tracker.samples("samples", [], 4)
    assert logged == [
        ({"samples": ("table", ["step", "prompt", "response", "reward"], [[3, "a", "b", 1.0], [3, "c", "d", 0.0]])}, 3)
    ]


@pytest.mark.parametrize("backend", ["wandb", "swanlab"])
def test_a_missing_optional_tracker_names_the_extra(monkeypatch, backend):
    monkeypatch.setitem(sys.modules, backend, None)  # as if not installed
    with pytest.raises(ConfigError, match=rf"pip install 'flash-rl\[{backend}\]'"):
        load_config(RECIPE, [f"tracking.backends=[tensorboard,{backend}]"])


def test_an_unknown_tracker_names_the_closest():
    with pytest.raises(ConfigError, match="did you mean 'tensorboard'"):
        load_config(RECIPE, ["tracking.backends=[tensorbord]"])


def test_console_backend_and_tensorboard_shorthand(tmp_path, capsys):
    cfg = load_config(RECIPE, ["tracking.tensorboard=false", "tracking.console_every=1"]).tracking
    tracker = make_tracker(cfg, str(tmp_path))
    tracker.log({"reward/mean": 0.5, "time/step": 1.0}, 1)
    tracker.close()
    assert "reward/mean=0.5" in capsys.readouterr().out
    assert not (tmp_path / "tb").exists()


def test_a_heartbeat_line_reaches_a_log_file_every_interval_with_phase_step_reward_accuracy():
    import io
    import time

    from flash.app.progress import Heartbeat, Progress

    out = io.StringIO()  # not a terminal, like a log file
    hb = Heartbeat(0.05, stream=out)
    hb.set(phase="warm start")
    hb.set(step=120, total=400)
    time.sleep(0.12)
    hb.set(phase="train", step=0, total=10, accuracy="0.250@0")
    Progress(10, True, hb, accuracy=(0.25, 0)).update({"step": 3, "reward/mean": 0.5, "time/elapsed": 4.0})
    time.sleep(0.12)
    hb.close()
    lines = out.getvalue().splitlines()
    assert any(re.search(r"warm start step 120/400 \(elapsed 0s, ~0s left\)$", x) for x in lines), lines
    assert re.search(r"train step 3/10 \(elapsed 4s, ETA settling\) reward 0.500 accuracy 0.250@0$", lines[-1]), lines
    assert all(x.startswith("flash: [") for x in lines) and len(lines) >= 3
    assert "step 120" not in Heartbeat(0, enabled=False).line()
    quiet = Heartbeat(0.01, enabled=False, stream=out)
    assert quiet._thread is None


@pytest.mark.parametrize(
    "done, total, elapsed, want",
    [
        (0, 400, 3.0, "(elapsed 3s, ~? left)"),
        (100, 400, 60.0, "(elapsed 1m00s, ~3m00s left)"),
        (120, 1000, 95.0, "(elapsed 1m35s, ~11m37s left)"),
        (10, 1000, 400.0, "(elapsed 6m40s, ~11h00m left)"),
        (400, 400, 59.6, "(elapsed 1m00s, ~0s left)"),
    ],
)
def test_the_warm_start_progress_shows_elapsed_and_time_left_at_its_rate(done, total, elapsed, want):
    from flash.app.progress import step_eta

    assert step_eta(done, total, elapsed) == want


def test_tensorboard_tags_name_each_eval_set_once(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = make_tracker(load_config(RECIPE, ["tracking.backends=[tensorboard]"]).tracking, str(tmp_path))
    tracker.log({"eval/eval/mean@4": 0.5, "eval/dev/mean@4": 0.25, "eval/accuracy": 0.5, "reward/mean": 0.125}, 3)
    tracker.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["eval/accuracy", "eval/dev/mean@4", "eval/mean@4", "reward/mean"]
    assert [(e.step, e.value) for e in events.Scalars("eval/mean@4")] == [(3, 0.5)]
