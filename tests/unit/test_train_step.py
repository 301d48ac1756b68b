"""The controller and `flash replay` train a step through the same code (flash.controllers.train_step),
and a step's metrics are assembled from named sources (flash.controllers.step_metrics).

The roles are fakes that record every call they get (launch and wait apart, as Ray futures are), so
the controller's step and the replay of its schedule line must make the same calls in the same
order: with a critic (``gae``) both report the critic's metrics, and the stream trainer keeps one
part in flight while the next group is collated (its advantages computed) in both.

The controller's own phases around the step run on the same fakes: colocated engines put to sleep
and woken, a batch waited for past the buffer's poll, the model-update group formed again after an
engine restart, and the ledger lines of the scheduler's outcomes and of what shutdown left.
"""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flash import algos
import flash.controllers.async_controller as ac
import flash.controllers.train_step as ts
from flash.buffers import SampleBuffer
from flash.buffers.types import Group, Sample
from flash.controllers import step_metrics as sm
from flash.controllers.staleness import StalenessManager
from flash.app import replay
from flash.app.schedule import step_line
from flash.sim.accounting import simulated_metrics

ROLE_CALLS = ("logprobs", "values", "train_step", "begin_step", "accumulate", "finish_step")


class Ref:
    def __init__(self, log, name, value):
        self.log, self.name, self.value = log, name, value


def fake_get(ref, **_):
    if isinstance(ref, list):
        return [fake_get(r) for r in ref]
    if not isinstance(ref, Ref):
        return ref
    if ref.name.split(".")[1] in ROLE_CALLS:
        ref.log.append(f"wait {ref.name}")
    return ref.value


class Actor:
    """Looks like a Ray actor handle: ``a.method.remote(...)`` records the launch, returns a Ref."""

    def __init__(self, name, log, obj):
        self._name, self._log, self._obj = name, log, obj

    def __getattr__(self, method):
        def remote(*args):
            name = f"{self._name}.{method}"
            if method in ROLE_CALLS:
                self._log.append(f"launch {name}")
            return Ref(self._log, name, getattr(self._obj, method)(*args))

        return SimpleNamespace(remote=remote)


class Trainer:
    """Its numbers are sums of what it was given, so equal numbers mean equal inputs."""

    def __init__(self):
        self.parts = 0.0

    def logprobs(self, batch):
        return batch.behav_logp - 0.01

    def train_step(self, batch, adv, prox, ref):
        loss = float((adv * batch.mask).sum()) + (0.0 if prox is None else float(prox.sum()))
        return {"loss": loss + (0.0 if ref is None else float(ref.sum())), "grad_norm": float(batch.mask.sum())}

    def begin_step(self):
        self.parts = 0.0

    def accumulate(self, batch, adv, prox, ref):
        self.parts += float((adv * batch.mask).sum()) + float(prox.sum())

    def finish_step(self):
        return {"loss": self.parts, "grad_norm": 1.0}

    def stats(self):
        return {"busy_s": 0.0}

    def get_weights(self):
        return {}


class Critic:
    def values(self, batch):
        return torch.full(batch.mask.shape, 0.25)

    def train_step(self, batch, returns, values):
        return {"critic/loss": float(((returns - values) * batch.mask).sum()), "critic/grad_norm": 0.5}


class Reference:
    def logprobs(self, batch):
        return batch.behav_logp * 2


class Engine:
    def stats(self):
        return {"busy_s": 0.0, "tokens_generated": 0.0}

    def busy_spans(self):
        return []

    def __getattr__(self, name):  # pause, resume, update_weights, sleep, wake_up
        return lambda *args: 0.0


class Supervisor:
    epoch = 0

    def __init__(self, engine):
        self.engine = engine

    def call(self, name, *args):
        return getattr(self.engine, name)(*args)

    def run(self, fn, exclusive=False):
        return fn()

    def pushed(self, weights, version):
        pass


class Scheduler:
    admitted, workflow = 0, None

    def check(self):
        pass

    def pending_versions(self):
        return []

    def metrics(self):
        return {}

    def drain_outcomes(self):
        return []

    def __getattr__(self, name):  # mark_trained, set_version, suspend, resume
        return lambda *args: None


def _groups(n=3):
    out = []
    for pid in range(n):
        samples = [
            Sample(
                prompt_id=pid,
                sample_index=i,
                prompt_ids=[1, 5],
                response_ids=[7, 8, 9][: 2 + (i + pid) % 2],
                behav_logprobs=np.array([-0.5, -0.25, -0.125][: 2 + (i + pid) % 2], dtype=np.float32),
                versions=np.zeros(2 + (i + pid) % 2, dtype=np.int64),
                reward=float((i + pid) % 2),
                finish_reason="stop",
                admitted_version=0,
            )
            for i in range(2)
        ]
        out.append(Group(prompt_id=pid, samples=samples, admitted_version=0, data_index=pid))
    return out


def _roles(log, critic=False, reference=False):
    return (
        Actor("trainer", log, Trainer()),
        Actor("critic", log, Critic()) if critic else None,
        Actor("reference", log, Reference()) if reference else None,
    )


def _controller_step(monkeypatch, groups, advantage, prox, stream, critic, reference, log=None):
    """One step of the real AsyncController on the fakes; (its metrics, the roles' call log)."""
    log = [] if log is None else log
    for module in (ac, ts):
        monkeypatch.setattr(module, "ray", SimpleNamespace(get=fake_get))
    buffer = SampleBuffer(16)
    for g in groups:
        buffer.put(g)
    engine = Engine()
    trainer, critic_actor, reference_actor = _roles(log, critic, reference)
    ctrl = ac.AsyncController(
        Actor("engine", log, engine),
        trainer,
        Scheduler(),
        buffer,
        StalenessManager(0.0, len(groups)),
        ac.ControllerSettings(len(groups), "continue", advantage, prox, stream=stream),
        critic=critic_actor,
        supervisor=Supervisor(engine),
        reference=reference_actor,
    )
    record = ctrl.step(0, admit_more=False)
    assert [g.prompt_id for g in record.groups] == [g.prompt_id for g in groups]
    return record.metrics, log


def _replay_step(monkeypatch, groups, advantage, prox, stream, critic, reference, log=None):
    """The replay of the same step from its schedule line; (the trainer's metrics, the call log)."""
    log = [] if log is None else log
    monkeypatch.setattr(ts, "ray", SimpleNamespace(get=fake_get))
    line = json.loads(json.dumps(step_line(0, groups, {"loss": 0.0}, {"prox": prox, "stream": stream})))
    cfg = SimpleNamespace(algo=SimpleNamespace(advantage=advantage))
    return replay._train(line, cfg, _roles(log, critic, reference), pad_id=0), log


@pytest.mark.parametrize("prox", ["separate", "behav"])
def test_replay_trains_a_critic_step_exactly_as_the_controller(monkeypatch, prox):
    advantage = {"name": "gae", "gamma": 1.0, "lam": 0.95}
    args = (_groups(), advantage, prox, False, True, True)
    metrics, ctrl_log = _controller_step(monkeypatch, *args)
    train, replay_log = _replay_step(monkeypatch, *args)
    assert ctrl_log == replay_log
    assert replay_log[:2] == [
        "launch reference.logprobs",
        *(["launch trainer.logprobs"] if prox == "separate" else ["launch critic.values"]),
    ]
    assert replay_log[-4:] == [
        "wait reference.logprobs",
        "launch trainer.train_step",
        "wait trainer.train_step",
        "wait critic.train_step",
    ]
    # the critic's metrics beside the trainer's, the same numbers in both
    assert set(train) == {"loss", "grad_norm", "critic/loss", "critic/grad_norm", "no_update"}
    assert {k: metrics[f"train/{k}"] for k in train} == train
    assert train["critic/grad_norm"] == 0.5 and train["grad_norm"] == 15.0  # 6 samples, 2 or 3 tokens


def test_the_stream_replay_keeps_one_part_in_flight_as_the_controller(monkeypatch):
    """Part k+1 is collated (its advantages computed) before part k is waited for, in both."""
    logs = []
    compute = algos.compute_advantages

    def logged(*args, **kwargs):
        logs[-1].append("advantages")
        return compute(*args, **kwargs)

    monkeypatch.setattr(algos, "compute_advantages", logged)
    args = (_groups(), {"name": "grpo"}, "behav", True, False, False)
    logs.append([])
    metrics, _ = _controller_step(monkeypatch, *args, log=logs[-1])
    logs.append([])
    train, _ = _replay_step(monkeypatch, *args, log=logs[-1])
    # the call logs of the roles, with the advantage computations between them
    ctrl_log, replay_log = ([x for x in log if x == "advantages" or "trainer." in x] for log in logs)
    assert (
        ctrl_log
        == replay_log
        == [
            "launch trainer.begin_step",
            "wait trainer.begin_step",
            "advantages",
            "launch trainer.accumulate",
            "advantages",
            "wait trainer.accumulate",
            "launch trainer.accumulate",
            "advantages",
            "wait trainer.accumulate",
            "launch trainer.accumulate",
            "wait trainer.accumulate",
            "launch trainer.finish_step",
            "wait trainer.finish_step",
        ]
    )
    assert metrics["train/loss"] == train["loss"]


def test_per_step_counters_and_the_logged_order():
    per_step = sm.PerStep("reward/cpu_s")
    # totals since the start -> per step; a retired worker's count leaves the sum: never negative
    assert [per_step({"reward/cpu_s": v, "reward/calls": 4.0})["reward/cpu_s"] for v in (1.0, 2.5, 2.0, 3.0)] == [
        1.0,
        1.5,
        0.0,
        1.0,
    ]
    assert sm.service_metrics({"depth": 3, "puts": 5}) == {"buffer/puts": 5}
    # the simulated seconds see the evaluation's and the elapsed time; the run's sources come last
    logged = sm.logged_metrics(
        {"time/step": 1.0, "buffer/depth": 3.0},
        {"time/eval": 2.0},
        4.0,
        lambda m: simulated_metrics(m, 0.5),
        [{"faults/engine": 0.0}],
    )
    assert logged == {
        "time/step": 1.0,
        "buffer/depth": 3.0,
        "time/eval": 2.0,
        "time/elapsed": 4.0,
        "sim/step_s": 2.0,
        "sim/eval_s": 4.0,
        "sim/elapsed_s": 8.0,
        "faults/engine": 0.0,
    }


def test_the_batch_sources():
    from flash.train.batch import collate, flatten

    groups = _groups()
    samples = flatten(groups)
    samples[0].versions[:] = -1  # one sample a step older
    batch = collate(samples)
    m = sm.batch_metrics(0, samples, batch)
    assert m["staleness/max"] == 1.0 and m["staleness/count_0"] == 5.0 and m["staleness/count_1"] == 1.0
    assert m["reward/mean"] == 0.5 and m["rollout/response_len_max"] == 3.0
    assert sm.token_metrics(batch, 2.0) == {"train/batch_tokens": 15.0, "train/tokens_per_s": 7.5}


@pytest.mark.parametrize("stream", [False, True])
def test_a_step_whose_groups_all_had_equal_reward_is_marked_no_update(monkeypatch, stream):
    """Every group's samples of one reward (GRPO): every advantage 0, ``train/no_update`` 1; one group
    with two rewards: 0. The replay reports it as the controller does."""
    equal = _groups()
    for g in equal:
        for s in g.samples:
            s.reward = float(g.prompt_id % 2)  # groups differ from each other, not within
    for groups, want in ((equal, 1.0), (_groups(), 0.0)):
        metrics, _ = _controller_step(monkeypatch, groups, {"name": "grpo"}, "behav", stream, False, False)
        train, _ = _replay_step(monkeypatch, groups, {"name": "grpo"}, "behav", stream, False, False)
        assert metrics["train/no_update"] == train["no_update"] == want
    assert ts.no_update([torch.zeros(2, 3), torch.zeros(1, 3)]) == 1.0
    assert ts.no_update([torch.zeros(2, 3), torch.tensor([[0.0, 1e-9, 0.0]])]) == 0.0


class CallLog(Engine):
    """An engine that records the calls the controller makes on it beside the roles' calls."""

    def __init__(self, log):
        self.log = log

    def __getattr__(self, name):  # pause, sleep, wake_up, resume, update_weights, abort
        return lambda *args: self.log.append(f"engine.{name}{args}") or 0.0


def _controller(monkeypatch, groups, settings, log, scheduler=None, **kw):
    for module in (ac, ts):
        monkeypatch.setattr(module, "ray", SimpleNamespace(get=fake_get))
    buffer = SampleBuffer(16)
    for g in groups:
        buffer.put(g)
    engine = CallLog(log)
    trainer, _, _ = _roles(log)
    return ac.AsyncController(
        Actor("engine", log, engine),
        trainer,
        scheduler or Scheduler(),
        buffer,
        StalenessManager(0.0, settings.prompts_per_step),
        settings,
        supervisor=kw.pop("supervisor", None) or Supervisor(engine),
        **kw,
    ), buffer


def test_colocated_engines_sleep_through_the_train_phase_and_wake_before_the_push(monkeypatch):
    log = []
    settings = ac.ControllerSettings(3, "restart", {"name": "grpo"}, "behav", colocated=True)
    ctrl, _ = _controller(monkeypatch, _groups(), settings, log)
    record = ctrl.step(0, admit_more=False)
    engine = [x.split("(<")[0] for x in log if x.startswith("engine.") or "train_step" in x]
    assert engine == [
        "engine.pause('restart',)",
        "engine.sleep(2,)",
        "launch trainer.train_step",
        "wait trainer.train_step",
        "engine.wake_up()",
        "engine.pause('restart',)",
        "engine.update_weights",
        "engine.resume()",
    ]  # the weights: the trainer's object ref
    assert {"time/sleep", "time/wake_up"} <= set(record.metrics)


def test_a_step_waits_past_the_buffer_poll_checking_the_scheduler(monkeypatch):
    import threading

    class Counting(Scheduler):
        checks = 0

        def check(self):
            self.checks += 1

    scheduler, late = Counting(), _groups(2)
    ctrl, buffer = _controller(
        monkeypatch, [], ac.ControllerSettings(2, "continue", {"name": "grpo"}, "behav"), [], scheduler
    )
    timer = threading.Timer(1.2, lambda: [buffer.put(g) for g in late])  # after the 1 s poll timed out
    timer.start()
    record = ctrl.step(0, admit_more=False)
    timer.join()
    assert [g.prompt_id for g in record.groups] == [0, 1]
    assert scheduler.checks >= 3  # in the batch rule (before and after the wait) and on the timeout


def test_after_an_engine_restart_the_model_update_group_is_formed_again_before_the_push(monkeypatch):
    log = []

    class Group:
        def reset(self):
            log.append("reset")

        def push(self, version):
            log.append(f"push {version}")
            return {"model_update/bytes": 640.0, "model_update/push_s": 0.5}

    engine = CallLog(log)
    restarted = Supervisor(engine)
    restarted.epoch = 1  # the engine process was replaced since the group was formed
    ctrl, _ = _controller(
        monkeypatch,
        _groups(),
        ac.ControllerSettings(3, "continue", {"name": "grpo"}, "behav"),
        log,
        model_update=Group(),
        supervisor=restarted,
    )
    m1 = ctrl.step(0).metrics
    restarted.epoch = 1  # no restart since: the group is used as it is
    for g in _groups(3):
        ctrl.buffer.put(g)
    ctrl.step(1, admit_more=False)
    assert [x for x in log if x in ("reset", "push 1", "push 2")] == ["reset", "push 1", "push 2"]
    assert m1["rollout/update_bytes"] == 640.0 and m1["model_update/push_s"] == 0.5
    assert not any(x.startswith("engine.update_weights") for x in log)  # nothing through the object store


def test_the_ledger_holds_the_schedulers_outcomes_and_what_shutdown_left(monkeypatch):
    import io

    class Ending(Scheduler):
        events = [
            [{"prompt_id": 7, "outcome": "filtered", "rule": "all_same_reward"}],
            [{"prompt_id": 9, "request": 2, "outcome": "aborted", "reason": "redundant"}],
        ]

        def drain_outcomes(self):
            return self.events.pop(0) if self.events else []

        def pending_ids(self):
            return [11, 12]

        def leftover(self):
            return [{"prompt_id": 13, "outcome": "queued"}]

    ledger, log = io.StringIO(), []
    ctrl, buffer = _controller(
        monkeypatch,
        _groups(2),
        ac.ControllerSettings(1, "continue", {"name": "grpo"}, "behav"),
        log,
        Ending(),
        ledger=ledger,
    )
    ctrl.step(0, admit_more=False)  # trains group 0; group 1 stays buffered
    left = ctrl.shutdown_rollout()
    assert left == {"in_flight": [11, 12], "buffered": [1]} and len(buffer) == 0
    assert log[-3:] == ["engine.pause('continue',)", "engine.abort(None,)", "engine.resume()"]
    lines = [json.loads(x) for x in ledger.getvalue().splitlines()]
    assert [(x["prompt_id"], x["outcome"], x.get("step")) for x in lines] == [
        (7, "filtered", 0),
        (0, "trained", 0),
        (0, "trained", 0),
        (9, "aborted", None),
        (11, "in_flight", None),
        (12, "in_flight", None),
        (1, "buffered", None),
        (13, "queued", None),
    ]
    assert lines[0]["rule"] == "all_same_reward" and lines[3]["reason"] == "redundant"
