"""How ``flash run`` builds agent rollout (``agent.fn`` set, or a task that runs agents, e.g.
``verifiers``): the gateway, the runner of the agents, and the scheduler core driving the agent
workflow over the task's items.

A unit is one run of the agent on one item; the core admits items under the staleness bound and
applies redundancy, filters and spares to agent runs as to any other unit.

Which tokens an episode trains: a session is one segment while every call extends the previous
context (flash.envs.chat_session); a call that cannot (a template that is not append-only, an
agent that edited its history) starts a new segment. The sample is the episode's **last**
segment: it holds the final context, every sampled token of its own calls trained; the sampled
tokens of earlier segments are counted (``agent/untrained_tokens``) but not trained, because a
segment is a separate sequence and a group's samples are one per unit.
"""

from __future__ import annotations

import functools

from flash.buffers import Sample, SampleBuffer
from .admission import PromptSource
from .filters import FilterConfig
from .scheduler import RolloutCore
from .staleness import StalenessManager
from .workflows.agent import Agents
from flash.engine.base import SamplingParams


def session_sample(
    record: dict | None,
    *,
    prompt_id: int,
    sample_index: int,
    admitted_version: int,
    reward: float,
    outcome: str,
    meta: dict,
    filler: tuple[int, ...] = (0,),
) -> Sample:
    """The episode's sample from its closed session (module docstring); an episode that made no
    call (its agent failed before one) is a sample of one ``filler`` token and no response, scored
    as its outcome says (nothing to train, but the ledger holds it). ``calls`` in its meta counts
    the calls whose tokens it holds (its segment's)."""
    segments = (record or {}).get("segments") or []
    calls = (record or {}).get("calls", [])
    meta = {
        **meta,
        "outcome": outcome,
        "segments": len(segments),
        "untrained_tokens": sum(sum(s.loss_mask) for s in segments[:-1]),
        "calls": sum(c["segment"] == len(segments) - 1 for c in calls),
    }
    if not segments:
        return Sample(
            prompt_id=prompt_id,
            sample_index=sample_index,
            prompt_ids=list(filler),
            response_ids=[],
            behav_logprobs=[],
            versions=[],
            reward=reward,
            finish_reason=outcome,
            admitted_version=admitted_version,
            meta=meta,
        )
    return segments[-1].to_sample(
        prompt_id=prompt_id,
        sample_index=sample_index,
        reward=reward,
        finish_reason=outcome,
        admitted_version=admitted_version,
        meta=meta,
    )


class AgentScheduler(RolloutCore):
    """The core running the agent workflow (one unit = one agent run on one item)."""

    def __init__(
        self,
        engine,
        workflow: Agents,
        task,
        buffer: SampleBuffer,
        staleness: StalenessManager,
        params: SamplingParams,
        n: int,
        seed: int,
        *,
        redundancy: int = 0,
        max_additional_prompts: int = 0,
        filters: FilterConfig | None = None,
        reward_workers: int = 4,
        client=None,
        decode=None,
    ):
        source = PromptSource(
            item=lambda i: task.item(i, "train"), encode=lambda prompt: [], decode=decode, reward=None
        )
        super().__init__(
            engine,
            workflow,
            source,
            buffer,
            staleness,
            params,
            n,
            seed,
            reward_workers,
            redundancy=redundancy,
            max_additional_prompts=max_additional_prompts,
            filters=filters,
            client=client,
        )


def build_agent_scheduler(cfg, task, tokenizer, engine, buffer, staleness, params, client=None):
    """Start the gateway and the agent runner, and the AgentScheduler that drives them."""
    from flash.envs.agents import AgentRunner, load_agent
    from flash.envs.gateway import Gateway
    from flash.errors import ConfigError
    from flash.models import decode_response

    if not tokenizer.chat_template:
        raise ConfigError(
            "agents talk to the policy through its chat template and the tokenizer has none: "
            "set model.chat_template (a Jinja string or a file)"
        )
    fn = load_agent(cfg.agent.fn) if cfg.agent.fn else task.agent
    # the ignore: ``generate`` is bound by the Agents workflow below (Agents.__init__), before any request
    gateway = Gateway(
        tokenizer,
        None,  # type: ignore[arg-type]
        host=cfg.agent.host,
        max_tokens_cap=cfg.rollout.max_new_tokens,
        default_max_tokens=cfg.rollout.max_new_tokens,
        workers=cfg.agent.concurrency + 4,
        tool_parser=cfg.agent.tool_parser,
        header_timeout_s=cfg.agent.header_timeout_s,
        body_timeout_s=cfg.agent.body_timeout_s,
        max_connections=cfg.agent.max_connections,
        raw_completion_prompts=cfg.agent.raw_completion_prompts,
    )
    url = gateway.start()
    hosts = None
    if cfg.agent.processes and cfg.agent.fn:  # a task's own agents (task.agent) run in the driver
        from flash.envs.agent_host import start_agent_hosts

        hosts = start_agent_hosts(
            cfg.agent.processes,
            cfg.agent.fn,
            url,
            cfg.agent.timeout_s,
            cfg.agent.concurrency,
            cfg.rollout.max_worker_restarts,
        )
    runner = AgentRunner(fn, url, cfg.agent.concurrency, cfg.agent.timeout_s, cfg.agent.retries, hosts)
    to_sample = functools.partial(session_sample, filler=(tokenizer.eos_token_id,))
    workflow = Agents(gateway, runner, to_sample, max_turns=cfg.agent.max_turns, call_timeout_s=cfg.agent.timeout_s)
    return AgentScheduler(
        engine,
        workflow,
        task,
        buffer,
        staleness,
        params,
        n=cfg.rollout.n,
        seed=cfg.seed,
        redundancy=cfg.rollout.redundancy,
        max_additional_prompts=cfg.rollout.max_additional_prompts,
        filters=cfg.rollout.filter,
        reward_workers=cfg.rollout.reward_workers,
        client=client,
        decode=lambda ids: decode_response(tokenizer, ids),
    )
