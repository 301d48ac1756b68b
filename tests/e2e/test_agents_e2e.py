"""User agents trained end to end: `flash run` with `agent.fn`, each episode one run of the agent
with a real `openai.AsyncOpenAI` client on its own gateway session, through the scheduler core.

The agent here answers the stutter task's prompt in one chat turn; the chat template is the raw
text after `<bos>`, so the policy sees what the single-turn recipe shows it (its warm start). What
must hold: the run finishes its steps with every planned sample trained once (the ledger), a
crashing agent is run again once on a fresh session and then counted as ok, redundant runs are
cancelled, and the staleness bound holds.
"""

import json

import pytest

from tests.helpers.processes import B, N, STEPS, finish, launch, read_jsonl, trained_pairs

RAW = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def cache(warm_cache):
    return warm_cache


def agent_run(tmp_path, cache, fn: str, env: dict | None = None, extra: tuple = ()) -> tuple:
    run_dir, template = tmp_path / "run", tmp_path / "raw.jinja"
    template.write_text(RAW)
    overrides = [
        f"run_dir={run_dir}",
        f"agent.fn=tests.agent_fns:{fn}",
        f"model.chat_template={template}",
        "checkpoint.every_steps=0",
        "async_ratio=1",
        *extra,
    ]
    finish(launch(run_dir, cache, overrides, env), run_dir)
    return run_dir, json.loads((run_dir / "summary.json").read_text()), read_jsonl(run_dir / "metrics.jsonl")


@pytest.mark.slow
def test_an_agent_run_trains_every_episode_once_through_the_gateway(tmp_path, cache):
    """Agents with random latency that crash on each item's first run, one redundant run per prompt
    (the first n to finish are kept, the other cancelled mid-run), async ratio 1: the crash is run
    again once, the bound holds, and every planned sample is trained once. (A hung agent's timeout
    and every other outcome are pinned without a run in test_agents.py.)"""
    marks = tmp_path / "marks"
    marks.mkdir()
    run_dir, summary, metrics = agent_run(
        tmp_path, cache, "flaky_slow_answer", {"FLASH_TEST_MARKS": str(marks)}, ("rollout.redundancy=1",)
    )
    assert summary["steps"] == STEPS and summary["samples_trained"] == STEPS * B * N
    pairs = trained_pairs(read_jsonl(run_dir / "ledger.jsonl"))
    assert set(pairs.values()) == {1} and len(pairs) == STEPS * B * N
    assert summary["max_staleness_observed"] <= 1 and summary["aborted_samples"].get("redundant", 0) > 0
    last = metrics[-1]
    assert last["agent/crashed"] == 0 and last["agent/timeout"] == 0 and last["agent/ok"] >= STEPS * B * N
    assert last["agent/retries"] >= STEPS * B  # each trained prompt's first run crashed, its retry did not
    assert last["agent/cancelled"] > 0  # the redundant runs, stopped at their next await
    assert last["gateway/calls"] >= STEPS * B * N and last["gateway/new_segments"] == 0
    assert 0.0 <= summary["eval_accuracy_final"] <= 1.0
