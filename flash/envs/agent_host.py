"""Agents in processes of their own: ``AgentHost`` Ray actors (``agent.processes`` >= 1).

A user's agent is arbitrary code: it may block its event loop (a synchronous HTTP call, a
``time.sleep``), leak memory or crash its interpreter. Run in the driver, any of these would stall
or kill the run; run here, each ``AgentHost`` is an async Ray actor holding an event loop on which
many agents run at once (``max_concurrency``), and the driver's ``AgentRunner`` only awaits them.

What can happen to a run on a host, and the outcome the runner names (``run_on_host`` in
flash.envs.agents, the driver's side):

- the agent returns or raises: ``ok``, ``bad_return`` or ``crashed``, decided in the host;
- it runs past ``timeout_s``: the driver cancels the call (the agent's next await raises) --
  ``timeout``; a host whose loop does not answer a ping within ``PING_S`` is blocked by an agent
  and is killed (Ray restarts it);
- the host process dies (killed, out of memory, a crash in native code): every run on it ends
  ``died``; Ray restarts the host (``max_restarts``) and the runs are retried there like any failure.
"""

from __future__ import annotations

import os
import sys


class AgentHost:
    """One agent process: an event loop running ``fn`` for each ``run`` call (see module docstring)."""

    def __init__(self, fn_path: str, base_url: str, timeout_s: float, search_path: list[str]):
        for path in search_path:  # the recipe's folder, so 'module:function' beside it imports here too
            if path not in sys.path:
                sys.path.append(path)
        import openai  # imported before the first ping answers: a slow first import is no hang

        from flash.envs.agents import load_agent

        self.fn, self.base_url, self.timeout_s = load_agent(fn_path), base_url, timeout_s
        self._http = openai.DefaultAsyncHttpxClient(timeout=timeout_s)  # one pool for every agent here

    async def run(self, item, key: str) -> tuple[str, float, dict, str]:
        """(outcome, reward, info, error) of one attempt on session ``key``."""
        from flash.envs.agents import call_agent

        return await call_agent(self.fn, self._http, self.base_url, key, self.timeout_s, item)

    async def ping(self) -> bool:
        return True

    def pid(self) -> int:
        return os.getpid()


def start_agent_hosts(
    count: int, fn_path: str, base_url: str, timeout_s: float, concurrency: int, max_restarts: int
) -> list:
    """``count`` AgentHost actors (no CPU reserved: agents mostly wait on the policy and their
    tools); a host that dies is restarted by Ray up to ``max_restarts`` times."""
    import ray

    actor = ray.remote(AgentHost).options(num_cpus=0, max_concurrency=max(1, concurrency), max_restarts=max_restarts)
    return [actor.remote(fn_path, base_url, timeout_s, list(sys.path)) for _ in range(count)]
