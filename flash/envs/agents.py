"""User agents run against the gateway: ``async def agent(client, item) -> float | (float, dict)``.

A recipe names the function as ``package.module:function`` (``agent.fn``); flash hands it a real
``openai.AsyncOpenAI`` client whose base URL is the gateway and whose API key is the episode's own
session key, so every call the agent makes is one turn of that episode (flash.envs.gateway). The
agent returns the episode's reward (and optionally a dict of facts kept in the sample's meta).

``AgentRunner`` runs agents on one asyncio loop in a daemon thread, at most ``concurrency`` at
once. Each run ends with a named outcome:

- ``ok``: it returned a reward (``flash.buffers.reward``: a finite real number);
- ``timeout``: it ran past ``timeout_s`` (a hung agent is cancelled at its next await);
- ``crashed``: it raised;
- ``bad_return``: it returned something other than a finite number or ``(number, dict)``;
- ``cancelled``: the scheduler no longer wants the episode (redundant, surplus);
- ``died``: the agent's process died under it (``agent.processes`` >= 1: flash.envs.agent_host).

With ``hosts`` (``AgentHost`` actors) the agents run in those processes and this loop only awaits
them, round robin; without, they run on this loop, in the driver.

A failed run (timeout, crashed, bad_return) is run once more on a fresh session (``retries``); a
second failure stands, and the episode is scored 0 with that outcome, so the ledger stays complete.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flash.buffers.reward import BadReward, reward_value

PING_S = 5.0  # a host's loop that does not answer within this is blocked by an agent
RESTART_S = 120.0  # how long an attempt waits for a restarting host before it counts as died
OUTCOMES = ("ok", "timeout", "crashed", "bad_return", "cancelled", "died")
# The tiny model's chat template for tool-using agents: "tools: NAME ..." when tools are offered, one
# "q:" / "a:" / "r:" (tool result) turn each, calls as hermes <tool_call> blocks, <eos> after each reply.
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}. {% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}a: {% if m['tool_calls'] %}{% for c in m['tool_calls'] %}"
    "<tool_call>{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] | tojson }}}"
    "</tool_call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}{{ eos_token }} "
    "{% elif m['role'] == 'tool' %}r: {{ m['content'] }} "
    "{% else %}q: {{ m['content'] }} {% endif %}"
    "{% endfor %}{% if add_generation_prompt %}a: {% endif %}"
)


@dataclass
class AgentResult:
    reward: float
    outcome: str
    attempts: int
    info: dict = field(default_factory=dict)
    error: str = ""


def load_agent(path: str) -> Callable:
    """The coroutine function ``package.module:function`` names (ValueError saying what is wrong)."""
    from flash.algos.registry import import_path

    fn = import_path(path, "agent.fn")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"agent.fn {path!r} must be an 'async def {path.partition(':')[2]}(client, item)' function")
    return fn


class BadReturn(ValueError):
    """An agent returned something that is not a reward."""


def check_return(value: Any) -> tuple[float, dict]:
    """``(reward, info)`` from what an agent returned; ``BadReturn`` for anything else."""
    reward, info = value if isinstance(value, tuple) and len(value) == 2 else (value, {})
    try:
        reward = reward_value(reward)
    except BadReward as exc:
        raise BadReturn(f"an agent returns a reward or (reward, dict), got {str(value)[:80]}: {exc}") from None
    if not isinstance(info, dict):
        raise BadReturn(f"an agent's second return value must be a dict, got {type(info).__name__}")
    return reward, _plain(info, "info", 0)


MAX_INFO_DEPTH = 8


def _plain(value: Any, where: str, depth: int) -> Any:
    """``info`` as JSON data: it becomes its samples' ``meta``, which checkpoints write as JSON and
    the buffer service carries as msgpack. NumPy scalars become Python numbers and tuples lists;
    anything else is a ``BadReturn`` naming where it is."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return value.item()
    if depth >= MAX_INFO_DEPTH:
        raise BadReturn(f"an agent's {where} nests deeper than {MAX_INFO_DEPTH}")
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if bad := [k for k in value if not isinstance(k, str)]:
            raise BadReturn(f"an agent's {where} has the key {bad[0]!r}; keys are strings")
        return {k: _plain(v, f"{where}[{k!r}]", depth + 1) for k, v in value.items()}
    raise BadReturn(
        f"an agent's {where} is a {type(value).__name__}; info holds JSON data (None, bool, int, "
        "float, str, and lists and str-keyed dicts of them)"
    )


class AgentRunner:
    """Agents on one asyncio loop thread (see the module docstring)."""

    def __init__(
        self,
        fn: Callable,
        base_url: str,
        concurrency: int = 16,
        timeout_s: float = 300.0,
        retries: int = 1,
        hosts: list | None = None,
    ):
        self.fn, self.base_url, self.timeout_s, self.retries = fn, base_url, timeout_s, retries
        self.hosts, self._turn = list(hosts or []), 0
        self.loop = asyncio.new_event_loop()
        self._slots = asyncio.Semaphore(max(1, concurrency))
        self._thread = threading.Thread(target=self.loop.run_forever, name="flash-agents", daemon=True)
        self._thread.start()
        self.counts: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.counts["retries"] = 0
        self._lock = threading.Lock()
        self._http = None  # the agents' shared HTTP connection pool, made on the loop

    def run(
        self,
        item,
        open_session: Callable[[], str],
        close_session: Callable[[str, str], None],
        done: Callable[[AgentResult], None],
    ) -> Future:
        """Start one episode: ``open_session()`` gives a session key for each attempt,
        ``close_session(key, outcome)`` ends it, ``done(result)`` hears the final result. The
        returned future can be cancelled (the episode's outcome is then ``cancelled``)."""
        return asyncio.run_coroutine_threadsafe(self._episode(item, open_session, close_session, done), self.loop)

    async def _episode(self, item, open_session, close_session, done) -> None:
        result, key = AgentResult(0.0, "crashed", 0), None
        try:
            async with self._slots:
                for attempt in range(1 + self.retries):
                    key = open_session()
                    result = await self._attempt(item, key, attempt + 1)
                    close_session(key, result.outcome)
                    key = None
                    if result.outcome == "ok":
                        break
                    if attempt < self.retries:
                        self._count("retries")
        except asyncio.CancelledError:
            if key is not None:
                close_session(key, "cancelled")
            self._count("cancelled")
            raise
        self._count(result.outcome)
        done(result)

    async def _attempt(self, item, key: str, attempt: int) -> AgentResult:
        if self.hosts:
            host, self._turn = self.hosts[self._turn % len(self.hosts)], self._turn + 1
            outcome, reward, info, error = await run_on_host(host, item, key, self.timeout_s)
            return AgentResult(reward, outcome, attempt, info, error)
        import openai

        if self._http is None:  # one connection pool for every agent: a client of its own costs ~45 ms
            self._http = openai.DefaultAsyncHttpxClient(timeout=self.timeout_s)
        try:
            outcome, reward, info, error = await asyncio.wait_for(
                call_agent(self.fn, self._http, self.base_url, key, self.timeout_s, item), self.timeout_s
            )
        except asyncio.TimeoutError:
            outcome, reward, info, error = "timeout", 0.0, {}, f"ran past {self.timeout_s}s"
        return AgentResult(reward, outcome, attempt, info, error)

    def _count(self, key: str) -> None:
        with self._lock:
            self.counts[key] = self.counts.get(key, 0) + 1

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return {f"agent/{k}": float(v) for k, v in self.counts.items()}

    def close(self) -> None:
        if self.hosts:
            import ray

            for host in self.hosts:
                ray.kill(host, no_restart=True)
        if self._http is not None and self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._http.aclose(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


async def call_agent(
    fn: Callable, http, base_url: str, key: str, timeout_s: float, item
) -> tuple[str, float, dict, str]:
    """(outcome, reward, info, error) of one run of ``fn`` on session ``key`` over the pool ``http``:
    ``ok``, ``bad_return`` or ``crashed`` (the caller applies the timeout). The driver's runner and
    an agent host (flash.envs.agent_host) both call it."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=timeout_s, http_client=http)
    try:
        reward, info = check_return(await fn(client, item))
        return "ok", reward, info, ""
    except BadReturn as exc:
        return "bad_return", 0.0, {}, str(exc)
    except Exception as exc:  # the user's code: any failure is its outcome, never the run's
        return "crashed", 0.0, {}, f"{type(exc).__name__}: {str(exc)[:300]}"


async def run_on_host(host, item, key: str, timeout_s: float) -> tuple[str, float, dict, str]:
    """One attempt on ``host`` with the driver's timeout (module docstring); a dead host is ``died``."""
    import ray

    if not await wait_ready(host, RESTART_S):
        return "died", 0.0, {}, f"the agent's process is down and did not come back within {RESTART_S:g}s"
    ref = host.run.remote(item, key)
    try:
        return await asyncio.wait_for(ref, timeout_s)
    except asyncio.CancelledError:  # the episode is no longer wanted: stop the agent too
        ray.cancel(ref)
        raise
    except asyncio.TimeoutError:
        ray.cancel(ref)
        if not await _answers(host):
            ray.kill(host, no_restart=False)
        return "timeout", 0.0, {}, f"ran past {timeout_s}s"
    except ray.exceptions.RayActorError as exc:
        return "died", 0.0, {}, f"the agent's process died: {str(exc).splitlines()[0][:200]}"


async def wait_ready(host, within_s: float) -> bool:
    """Whether ``host`` answers a ping, waiting up to ``within_s`` while Ray restarts it."""
    import ray

    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        try:
            return await asyncio.wait_for(host.ping.remote(), PING_S)
        except (asyncio.TimeoutError, ray.exceptions.RayActorError):
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.2)


async def _answers(host) -> bool:
    import ray

    try:
        return await asyncio.wait_for(host.ping.remote(), PING_S)
    except (asyncio.TimeoutError, ray.exceptions.RayActorError):
        return False
