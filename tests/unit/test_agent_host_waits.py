"""Agent hosts and reward workers without Ray: the driver's side of a host (flash.envs.agents:
``wait_ready``, ``run_on_host``, ``_answers``) over scripted actor handles (a host that does not
answer its pings, one that comes back, one whose process dies under a run); ``AgentHost`` and
``RewardScorer`` (the actors' classes) called directly; the reward pool's scaling loop
(flash.rewards.autoscale: ``run_scaler``) over a scripted pool."""

import asyncio
import threading

import ray.exceptions

from flash.envs import agents
from tests.helpers.waiting import wait_until
from flash.rewards.autoscale import AutoscaleConfig, Autoscaler, run_scaler


class _Method:
    def __init__(self, fn):
        self.remote = fn


class ScriptedHost:
    """An AgentHost handle: ``ping.remote()`` answers after ``down`` failed pings (a ping of a
    host that is down hangs); ``run.remote()`` runs ``run``."""

    def __init__(self, down: int, run=None):
        self.down, self.pings = down, 0
        self.ping = _Method(self._ping)
        self.run = _Method(run or (lambda item, key: None))

    async def _ping(self):
        self.pings += 1
        if self.pings <= self.down:
            await asyncio.sleep(3600)
        return True


def test_a_host_is_waited_for_while_it_restarts_and_counts_as_died_when_it_never_returns(monkeypatch):
    monkeypatch.setattr(agents, "PING_S", 0.01)
    back = ScriptedHost(down=2)
    assert asyncio.run(agents.wait_ready(back, within_s=5.0)) is True and back.pings == 3
    monkeypatch.setattr(agents, "RESTART_S", 0.05)
    gone = ScriptedHost(down=10**6)
    outcome, reward, info, error = asyncio.run(agents.run_on_host(gone, None, "k0", timeout_s=1.0))
    assert (outcome, reward, info) == ("died", 0.0, {}) and "did not come back within 0.05s" in error
    assert gone.pings >= 2  # pinged again after each 0.2 s pause until the deadline passed
    assert asyncio.run(agents._answers(ScriptedHost(down=1))) is False  # a blocked loop: no answer
    assert asyncio.run(agents._answers(ScriptedHost(down=0))) is True


def test_a_run_whose_host_process_dies_ends_died_naming_the_actor_error(monkeypatch):
    async def dies(item, key):
        raise ray.exceptions.RayActorError()

    out = asyncio.run(agents.run_on_host(ScriptedHost(down=0, run=dies), None, "k0", timeout_s=1.0))
    assert out[:3] == ("died", 0.0, {})
    assert out[3] == "the agent's process died: The actor experienced an error before finishing this task."

    async def answers(item, key):
        return "ok", 1.0, {"turns": 2}, ""

    assert asyncio.run(agents.run_on_host(ScriptedHost(down=0, run=answers), None, "k0", 1.0)) == (
        "ok",
        1.0,
        {"turns": 2},
        "",
    )


def test_an_agent_host_runs_its_agent_names_the_outcome_and_answers_pings():
    import os

    from flash.envs.agent_host import AgentHost
    from flash.tasks import TaskItem

    host = AgentHost("tests.agent_fns:not_a_reward", "http://127.0.0.1:9/v1", 5.0, [os.getcwd()])
    outcome, reward, info, error = asyncio.run(host.run(TaskItem(0, "p", "a"), "k0"))
    assert (outcome, reward, info) == ("bad_return", 0.0, {}) and "got yes" in error
    assert asyncio.run(host.ping()) is True and host.pid() == os.getpid()


class ScriptedPool:
    """What ``run_scaler`` reads and calls on a RewardPool: its queue, size and ``resize``."""

    def __init__(self, queued: int):
        self.queued, self.num_workers, self.concurrency, self.resizes = queued, 1, 1, []

    def resize(self, n: int) -> None:
        self.resizes.append(n)
        self.num_workers = n


def test_the_scaling_loop_resizes_the_pool_to_what_the_scaler_wants_until_stopped():
    cfg = AutoscaleConfig(min_workers=1, max_workers=3, scale_up_queue=1.0, scale_down_idle_s=0.0, interval_s=0.01)
    pool, stop = ScriptedPool(queued=5), threading.Event()
    thread = threading.Thread(target=run_scaler, args=(pool, Autoscaler(cfg), stop))
    thread.start()
    wait_until(lambda: pool.num_workers == 3, what="3 workers")
    pool.queued = 0  # the burst is over: one worker fewer per tick, down to min_workers
    wait_until(lambda: pool.num_workers == 1, what="1 worker")
    stop.set()
    thread.join(5)
    assert not thread.is_alive() and pool.resizes == [3, 2, 1]  # 5 calls at 1 per worker: capped at 3


def test_a_reward_worker_names_each_failure_and_counts_a_call_stuck_past_its_timeout():
    from flash.rewards.workers import RewardScorer
    from flash.tasks import TaskItem

    item = TaskItem(0, "p", "1/2")
    result, stuck = RewardScorer({"name": "tests.reward_fns:divide_by_zero"}, timeout_s=5.0).score(item, "x")
    assert (result.reward, result.reason, stuck) == (0.0, "error:ZeroDivisionError", 0)
    assert "division by zero" in result.error
    result, _ = RewardScorer({"name": "tests.reward_fns:not_a_number"}, timeout_s=5.0).score(item, "x")
    assert (result.reward, result.reason) == (0.0, "error:BadReward") and result.error
    slow = RewardScorer({"name": "tests.reward_fns:slow", "seconds": 0.3}, timeout_s=0.05)
    result, stuck = slow.score(item, "x")
    assert (result.reward, result.reason, stuck) == (0.0, "timeout", 1) and 0.05 <= result.wall_s < 0.3
    assert slow.metrics()["reward/stuck_calls"] == 1.0  # the call still runs in its thread ...
    threading.Event().wait(0.5)
    assert slow.metrics()["reward/stuck_calls"] == 0.0  # ... until it ends
    exact = RewardScorer({"name": "tests.reward_fns:exact"}, timeout_s=5.0)
    assert exact.ready() and exact.score(item, "1/2")[0].reward == 1.0


def test_the_agent_workflow_asks_waiting_turns_again_and_stop_fails_them_and_cancels_the_agents():
    from concurrent.futures import Future
    from types import SimpleNamespace

    from flash.controllers.workflows.agent import Agents, _Run
    from flash.controllers.workflows.base import Unit
    from flash.engine.base import GenerationRequest, SamplingParams

    submitted, closed = [], []
    agents = Agents(
        SimpleNamespace(close=lambda: closed.append("gateway")),
        SimpleNamespace(close=lambda: closed.append("runner")),
        to_sample=None,
    )
    agents.core = SimpleNamespace(supervisor=SimpleNamespace(submit=submitted.append))
    runs = []
    for i in range(2):
        run = _Run(Unit(f"u{i}", 5, i, SimpleNamespace(), [], SamplingParams()), future=Future())
        run.waiting[f"u{i}/0"] = (GenerationRequest(f"u{i}/0", [1], SamplingParams()), Future())
        agents._runs[run.unit.id] = run
        runs.append(run)
    assert agents.requeue([], None) == 2 and [r.request_id for r in submitted[0]] == ["u0/0", "u1/0"]
    assert agents.requeue([], ["u1/0", "u9/0"]) == 1 and [r.request_id for r in submitted[1]] == ["u1/0"]
    waiters = [w for run in runs for _, w in run.waiting.values()]
    agents.stop()
    assert [str(w.exception()) for w in waiters] == ["the run is stopping"] * 2
    assert all(run.cancelled and run.future.cancelled() for run in runs) and closed == ["runner", "gateway"]
    assert agents.requeue([], None) == 0 and len(submitted) == 2  # nothing left to ask again


class ScriptedRunner:
    """An AgentRunner that keeps each episode's callbacks; the test plays the agent."""

    def __init__(self):
        self.episodes = []

    def run(self, item, open_session, close_session, done):
        from concurrent.futures import Future

        self.episodes.append((open_session, close_session, done, Future()))
        return self.episodes[-1][3]

    def metrics(self):
        return {"agent/ok": 1.0}


def test_an_agent_s_call_is_an_engine_turn_of_its_unit_answered_by_route_and_cancel_aborts_it():
    from types import SimpleNamespace

    from flash.controllers.workflows.agent import Agents
    from flash.controllers.workflows.base import Unit
    from flash.engine.base import GenerationOutput, SamplingParams

    gateway = SimpleNamespace(
        open_session=lambda meta: f"key-{meta['unit']}",
        metrics=lambda: {"calls": 2},
        close_session=lambda key: {"key": key},
    )
    submitted, aborted, delivered = [], [], []
    agents = Agents(
        gateway, ScriptedRunner(), to_sample=lambda record, **kw: SimpleNamespace(record=record, meta={}), max_turns=1
    )
    runner = agents.runner
    agents.core = SimpleNamespace(
        supervisor=SimpleNamespace(submit=submitted.extend, call=lambda name, ids: aborted.append((name, ids))),
        deliver=delivered.extend,
    )
    params = SamplingParams(max_new_tokens=8, temperature=0.7, seed=11)
    agents.launch([Unit(f"u{i}", 5, i, SimpleNamespace(), [], params) for i in range(2)])
    keys = [episode[0]() for episode in runner.episodes]
    assert keys == ["key-u0", "key-u1"]
    replies: list = []
    answered = threading.Thread(target=lambda: replies.append(agents.generate([1, 2], SamplingParams(100), keys[0])))
    failed = threading.Thread(
        target=lambda: replies.append(_raises(agents.generate, [3], SamplingParams(100), keys[1]))
    )
    answered.start(), failed.start()
    wait_until(lambda: len(submitted) == 2, what="both turns submitted")
    req = next(r for r in submitted if r.request_id == "u0/0")
    assert (req.prompt_ids, req.params.max_new_tokens, req.params.temperature) == ([1, 2], 8, 0.7)
    agents.cancel(["u1"])
    out = GenerationOutput("u0/0", [1, 2], [7], [-0.5], [0], "stop")
    assert agents.route([out]) == []
    answered.join(5), failed.join(5)
    assert out in replies and "the episode was cancelled" in replies and aborted == [("abort", ["u1/0"])]
    assert runner.episodes[1][3].cancelled()
    assert _raises(agents.generate, [1], params, keys[0]) == "the agent made more than 1 calls in one episode"
    runner.episodes[0][1](keys[0], "ok")
    runner.episodes[0][2](SimpleNamespace(reward=1.0, outcome="ok", attempts=1, info={}))
    assert agents.finish(SimpleNamespace(id="u0"), out).record == {"key": "key-u0"}
    assert [o.request_id for o in delivered] == ["u0"] and agents.metrics()["gateway/calls"] == 2.0
    assert _raises(agents.generate, [1], params, "key-u9") == "the episode of this session has ended"


def _raises(fn, *args) -> str:
    try:
        fn(*args)
    except RuntimeError as exc:
        return str(exc)
    return ""
