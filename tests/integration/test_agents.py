"""User agents (flash.envs.agents): outcomes, the one retry, cancellation, loading by path."""

import re
import threading

import numpy as np
import pytest

from flash.envs.agents import AgentRunner, check_return, load_agent
from flash.tasks import TaskItem


class Sessions:
    """Session keys handed out and closed, as the gateway would (the agents here make no call)."""

    def __init__(self):
        self.opened, self.closed = [], []

    def open(self):
        self.opened.append(f"k{len(self.opened)}")
        return self.opened[-1]

    def close(self, key, outcome):
        self.closed.append((key, outcome))


def run_one(fn, timeout_s=5.0, retries=1):
    runner = AgentRunner(fn, "http://127.0.0.1:9/v1", concurrency=2, timeout_s=timeout_s, retries=retries)
    sessions, got, done = Sessions(), [], threading.Event()
    runner.run(TaskItem(3, "p", "a"), sessions.open, sessions.close, lambda r: (got.append(r), done.set()))
    assert done.wait(30)
    runner.close()
    return got[0], sessions, runner.metrics()


def test_each_failure_is_named_and_run_again_once_on_a_fresh_session():
    from tests import agent_fns

    result, sessions, m = run_one(agent_fns.hang, timeout_s=0.2)
    assert (result.outcome, result.attempts, result.reward) == ("timeout", 2, 0.0)
    assert sessions.closed == [("k0", "timeout"), ("k1", "timeout")] and m["agent/retries"] == 1.0
    result, sessions, m = run_one(agent_fns.not_a_reward)
    assert (result.outcome, result.attempts) == ("bad_return", 2) and "got yes" in result.error
    calls = []

    async def flaky(client, item):
        calls.append(item.index)
        if len(calls) == 1:
            raise KeyError("tool")
        return 0.5, {"tries": len(calls)}

    result, sessions, m = run_one(flaky)
    assert (result.outcome, result.reward, result.info, result.attempts) == ("ok", 0.5, {"tries": 2}, 2)
    assert sessions.closed == [("k0", "crashed"), ("k1", "ok")]
    assert m["agent/ok"] == 1.0 and m["agent/crashed"] == 0.0 and m["agent/retries"] == 1.0


def test_a_cancelled_agent_closes_its_session_and_reports_nothing():
    from tests import agent_fns

    runner = AgentRunner(agent_fns.hang, "http://127.0.0.1:9/v1", timeout_s=60)
    sessions, got = Sessions(), []
    future = runner.run(TaskItem(0, "p", "a"), sessions.open, sessions.close, got.append)
    for _ in range(100):
        if sessions.opened:
            break
        threading.Event().wait(0.01)
    future.cancel()
    threading.Event().wait(0.2)
    runner.close()
    assert got == [] and sessions.closed == [("k0", "cancelled")] and runner.metrics()["agent/cancelled"] == 1.0


def test_returns_and_paths_are_checked():
    assert check_return(1) == (1.0, {}) and check_return((0.5, {"a": 1})) == (0.5, {"a": 1})
    for bad in (float("nan"), True, "1", (1.0, 2), None):
        with pytest.raises(ValueError):
            check_return(bad)
    # info becomes its samples' meta (checkpointed as JSON, sent as msgpack): plain data only
    info = {"p": np.float32(0.5), "steps": (1, np.int64(2)), "tools": {"calc": [True, None, "x"]}}
    assert check_return((1.0, info)) == (1.0, {"p": 0.5, "steps": [1, 2], "tools": {"calc": [True, None, "x"]}})
    for bad, where in (
        ({"raw": b"x"}, "info['raw'] is a bytes"),
        ({"s": {1, 2}}, "info['s'] is a set"),
        ({"t": [object()]}, "info['t'][0] is a object"),
        ({0: 1}, "has the key 0"),
        ({"deep": [[[[[[[[[1]]]]]]]]]}, "nests deeper than 8"),
    ):
        with pytest.raises(ValueError, match=re.escape(where)):
            check_return((1.0, bad))
    assert load_agent("tests.agent_fns:answer").__name__ == "answer"
    with pytest.raises(ValueError, match="must be an 'async def"):
        load_agent("tests.reward_fns:exact")
    with pytest.raises(ValueError, match="cannot import"):
        load_agent("tests.nowhere:x")
    with pytest.raises(ValueError, match="package.module:function"):
        load_agent("answer")


def host_run(ray_local, tmp_path, fn, timeout_s, kill=False):
    """One item on one AgentHost process; with ``kill``, the host is SIGKILLed once the agent started."""
    import os
    import signal

    import ray

    from flash.envs.agent_host import start_agent_hosts

    (host,) = start_agent_hosts(1, f"tests.agent_fns:{fn}", "http://127.0.0.1:9/v1", timeout_s, 8, max_restarts=2)
    pid = ray.get(host.pid.remote())
    runner = AgentRunner(None, "http://127.0.0.1:9/v1", timeout_s=timeout_s, hosts=[host])
    sessions, got, done = Sessions(), [], threading.Event()
    runner.run(
        TaskItem(4, "p", "a", meta={"marks": str(tmp_path)}),
        sessions.open,
        sessions.close,
        lambda r: (got.append(r), done.set()),
    )
    if kill:
        for _ in range(300):
            if (tmp_path / "4").exists():
                break
            threading.Event().wait(0.05)
        os.kill(pid, signal.SIGKILL)
    assert done.wait(90)
    new_pid = ray.get(host.pid.remote())  # answered once the host is back (the retry waited for it)
    runner.close()
    return got[0], sessions, runner.metrics(), pid != new_pid


def test_a_killed_agent_process_ends_died_and_the_episode_runs_again(ray_local, tmp_path):
    result, sessions, m, restarted = host_run(ray_local, tmp_path, "stall_once", timeout_s=60, kill=True)
    assert (result.outcome, result.reward, result.attempts) == ("ok", 1.0, 2) and restarted
    assert sessions.closed == [("k0", "died"), ("k1", "ok")] and m["agent/retries"] == 1.0


def test_a_hung_agent_is_cancelled_and_one_blocking_its_process_gets_the_process_killed(
    ray_local, tmp_path, monkeypatch
):
    from flash.envs import agents

    (tmp_path / "a").mkdir()
    result, sessions, m, restarted = host_run(ray_local, tmp_path / "a", "stall_once", timeout_s=3.0)
    assert (result.outcome, result.attempts) == ("ok", 2) and not restarted  # cancelled at its await
    assert sessions.closed == [("k0", "timeout"), ("k1", "ok")]
    monkeypatch.setattr(agents, "PING_S", 1.0)
    (tmp_path / "b").mkdir()
    result, sessions, m, restarted = host_run(ray_local, tmp_path / "b", "block_once", timeout_s=3.0)
    assert (result.outcome, result.attempts) == ("ok", 2) and restarted  # its loop never answered: killed
    assert sessions.closed == [("k0", "timeout"), ("k1", "ok")] and m["agent/timeout"] == 0.0
