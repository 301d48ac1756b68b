"""The episode workflow's decisions on one episode, in-process: a stand-in core records what the
workflow submits, aborts and delivers; the environments are real ``corridor`` games in an
in-process ``EnvWorker`` (the Ray calls and worker faults: tests/e2e/test_worker_faults.py)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from flash.controllers.workflows.base import Unit
from flash.controllers.workflows.env_faults import _EpisodeHung, _EpisodeLost
from flash.controllers.workflows.episode import EpisodeCodec, Episodes
from flash.engine.base import GenerationOutput, SamplingParams
from flash.envs.worker import EnvWorker

CODEC = EpisodeCodec(
    encode_prompt=lambda text: [ord(c) for c in text],
    encode_observation=lambda text: [ord(c) for c in text],
    decode=lambda ids: "".join(map(chr, ids)),
)


class Core:
    """What the workflow reads of its ``RolloutCore``: records submits, aborts and deliveries."""

    n = 2

    def __init__(self):
        self.counters: dict[str, float] = {}
        self.submitted, self.aborted, self.delivered = [], [], []
        self.supervisor = SimpleNamespace(submit=self.submitted.extend, call=lambda name, ids: self.aborted.extend(ids))
        self.admission = SimpleNamespace(stopped=threading.Event(), version=0)

    def deliver(self, outputs):
        self.delivered.extend(o.request_id for o in outputs)


def make(faults=None):
    """A workflow on one in-process corridor worker; ``faults[(unit id, method)]`` is raised once."""
    env = EnvWorker("corridor", {"width": 8, "slack": 1})
    closed: list[str] = []
    handle = SimpleNamespace(close=SimpleNamespace(remote=closed.append))
    wf = Episodes([handle], CODEC, max_turns=12, env_threads=1)
    wf.core = core = Core()
    wf._launch = lambda call: call()  # environment calls run at once, in this thread
    pending = dict(faults or {})

    def call(ep, method, *args):
        exc = pending.pop((ep.key, method), None)
        if exc is not None:
            raise exc
        return getattr(env, method)(*args)

    wf._env = call
    return wf, core, closed


def unit(k: int, prompt_id: int = 0) -> Unit:
    item = SimpleNamespace(meta={"seed": 3})
    return Unit(f"{prompt_id}:{k}", prompt_id, k, item, [], SamplingParams(max_new_tokens=1, seed=11))


def answer(wf, core, action: str, reason: str = "stop") -> str:
    """Answer the latest submitted turn with ``action``; its request id."""
    req = core.submitted[-1]
    wf.route([GenerationOutput(req.request_id, list(req.prompt_ids), [ord(action)], [-0.5], [0], reason)])
    return req.request_id


def test_aborted_and_refused_turns_and_late_outputs():
    wf, core, closed = make()
    wf.launch([unit(0)])
    assert [r.request_id for r in core.submitted] == ["0:0/0"]
    answer(wf, core, "r", "abort")  # the engine aborted it: the same turn, same seed, asked again
    assert [(r.request_id, r.params.seed) for r in core.submitted[1:]] == [("0:0/0", core.submitted[0].params.seed)]
    answer(wf, core, "r", "error")  # refused (context full): the episode ends, scored so far
    assert core.delivered == ["0:0"] and closed == ["0:0"]
    sample = wf.finish(unit(0), None)
    assert sample.finish_reason == "request_error" and sample.reward == 0.0
    answer(wf, core, "r")  # the refused turn answered again (around a restart): counted, ignored
    c = wf.counters
    assert (c["turns_aborted"], c["request_errors"], c["duplicate_outputs"], c["outcome/request_error"]) == (1, 1, 1, 1)


def test_cancel_aborts_the_pending_turn_releases_the_env_and_drops_its_late_output():
    wf, core, closed = make()
    wf.launch([unit(0), unit(1)])
    wf.cancel(["0:1", "9:9"])  # an unknown id is skipped
    assert core.aborted == ["0:1/0"] and closed == ["0:1"] and wf.counters["episodes_cancelled"] == 1
    wf.route([GenerationOutput("0:1/0", [], [ord("r")], [-0.5], [0], "abort")])  # its late output
    assert "duplicate_outputs" not in wf.counters and wf._dropped == set()
    core.admission.stopped.set()  # admission stopped: a training episode goes no further
    first = next(r for r in core.submitted if r.request_id == "0:0/0")
    wf.route([GenerationOutput("0:0/0", list(first.prompt_ids), [ord("r")], [-0.5], [0], "stop")])
    assert wf.counters["episodes_halted"] == 1 and closed == ["0:1", "0:0"]
    assert core.delivered == [] and [r.request_id for r in core.submitted] == ["0:0/0", "0:1/0"]


def test_a_lost_worker_replays_the_episode_and_a_second_hang_ends_it():
    lost = {("0:0", "step"): _EpisodeLost()}
    wf, core, closed = make(lost)
    wf.launch([unit(0)])
    answer(wf, core, "r")  # the step's worker died: reset again, turn 0 asked again
    assert [r.request_id for r in core.submitted] == ["0:0/0", "0:0/0"]
    assert core.submitted[0].prompt_ids == core.submitted[1].prompt_ids  # same seed, same board
    wf._env = lambda ep, method, *args: (_ for _ in ()).throw(_EpisodeHung())
    answer(wf, core, "r")
    sample = wf.finish(unit(0), None)
    assert sample.finish_reason == "env_hung" and wf.counters["outcome/env_hung"] == 1 and closed == ["0:0"]


def test_a_nan_reward_ends_the_episode_as_an_env_error():
    wf, core, _ = make()
    wf._env = lambda ep, method, *args: "..a....g." if method == "reset" else ("..a...g.", float("nan"), False, {})
    wf.launch([unit(0)])
    answer(wf, core, "r")
    sample = wf.finish(unit(0), None)
    assert sample.finish_reason == "env_error" and wf.counters["env_errors"] == 1
    assert wf.last_env_error.startswith("step returned reward nan")


def test_a_worker_death_is_counted_once_per_new_process_and_stops_the_run_past_the_budget():
    import pytest

    from flash.controllers.workflows.env_faults import EnvFailed

    wf, _, _ = make()
    wf.max_worker_restarts, wf._pids = 1, [100]
    heard: list[dict] = []
    wf.on_event = heard.append
    wf._wait_restarted = lambda slot, kind, exc: 101  # Ray brought worker 0 back as process 101
    wf._worker_lost(0, "died", RuntimeError("killed"))
    wf._worker_lost(0, "died", RuntimeError("killed"))  # a second episode of the same death
    assert wf.faults == 1 and wf._pids == [101] and wf.metrics()["faults/env"] == 1.0
    assert [(e["event"], e["kind"], e["error"], e["worker"], e["pid"]) for e in heard] == [
        ("env_fault", "died", "RuntimeError", 0, 101)
    ] and wf.events == heard
    wf._wait_restarted = lambda slot, kind, exc: 102
    with pytest.raises(EnvFailed, match=r"died 2 times \(rollout.max_worker_restarts=1\)"):
        wf._worker_lost(0, "hung", TimeoutError())
