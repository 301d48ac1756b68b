"""verifiers environments run unchanged (flash/envs/verifiers_env.py): ``task.name: verifiers``.

The environment modules are written here, as a user writes them for the verifiers library (its
classic API: ``vf.SingleTurnEnv``, ``vf.MultiTurnEnv``, ``vf.ToolEnv``, ``vf.Rubric``). What must
hold: every way the module can fail to load is one line naming the fix (``flash validate`` too);
each kind of environment's rollout runs through the real gateway, scored by its own rubric, and
the episode's sample holds exactly the sampled tokens; ``flash run`` trains each kind end to end
with the rubric's rewards.
"""

from __future__ import annotations

import asyncio
import json
import textwrap

import pytest

vf = pytest.importorskip("verifiers", reason="the verifiers extra: pip install 'flash-rl[verifiers]'")

from flash.buffers.facts import clean_facts  # noqa: E402
from flash.controllers.agent_runtime import session_sample  # noqa: E402
from flash.app.config import load_config  # noqa: E402
from flash.engine.base import GenerationOutput  # noqa: E402
from flash.envs.gateway import Gateway  # noqa: E402
from flash.envs.verifiers_env import VerifiersOptions, VerifiersTask, load_environment  # noqa: E402
from flash.errors import ConfigError  # noqa: E402
from flash.models import DEFAULT_ALPHABET, build_tokenizer  # noqa: E402
from tests.helpers.processes import launch, finish, read_jsonl  # noqa: E402

# One module, three environments (``kind``). The rubric's reward is a function of the last reply's
# text (so the test can tell it computed it); it logs each score to ``log`` as JSON lines.
ENV_MODULE = textwrap.dedent('''
    import json
    import verifiers as vf
    from datasets import Dataset

    ROWS = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a in range(1, 6) for b in range(1, 6)]


    def add(a: int, b: int) -> int:
        """the sum of a and b"""
        return a + b


    class Echo(vf.MultiTurnEnv):
        """Says 'again' after each reply; two replies end the episode."""

        async def env_response(self, messages, state, **kwargs):
            return [{"role": "user", "content": "again"}]


    def load_environment(kind="single", log=""):
        def score(completion, answer, **kwargs):
            text = completion[-1]["content"] if completion and isinstance(completion[-1]["content"], str) else ""
            reward = 1.0 if text.strip() == answer else len(text) / 100
            if log:
                with open(log, "a") as f:
                    f.write(json.dumps({"text": text, "reward": reward}) + "\\n")
            return reward

        rubric, data = vf.Rubric(funcs=[score]), Dataset.from_list(ROWS)
        if kind == "single":
            return vf.SingleTurnEnv(dataset=data, rubric=rubric)
        if kind == "multi":
            return Echo(dataset=data, rubric=rubric, max_turns=2)
        return vf.ToolEnv(dataset=data, tools=[add], rubric=rubric, max_turns=3)
''')


@pytest.fixture
def env_file(tmp_path):
    path = tmp_path / "arith_env.py"
    path.write_text(ENV_MODULE)
    return path


@pytest.mark.parametrize(
    "source, args, error",
    [
        ("no_such_env_module", {}, "cannot import it"),
        ("missing.py", {}, "no such file"),
        (
            "def load_environment(**kw):\n    raise RuntimeError('needs an API key')\n",
            {},
            "load_environment(**task.args) failed: RuntimeError: needs an API key",
        ),
        ("x = 1\n", {}, "has no load_environment function"),
        ("def load_environment(**kw):\n    return 3\n", {}, "returned a int, not a verifiers Environment"),
        ("raise ImportError('no module named foo')\n", {}, "importing it failed: ImportError"),
        (None, {"kind": "single", "colour": 1}, "unexpected keyword argument 'colour' (check task.args)"),
    ],
)
def test_a_module_that_cannot_give_an_environment_is_one_line_naming_the_fix(tmp_path, env_file, source, args, error):
    if source is None:
        env = str(env_file)
    elif source.endswith(".py") or " " not in source:
        env = source if not source.endswith(".py") else str(tmp_path / source)
    else:
        bad = tmp_path / f"bad_{abs(hash(source))}.py"
        bad.write_text(source)
        env = str(bad)
    with pytest.raises(ValueError) as caught:
        load_environment(env, args)
    assert error in str(caught.value) and "\n" not in str(caught.value)


def test_flash_validate_loads_the_environment_beside_the_recipe(tmp_path, env_file):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("task:\n  name: verifiers\n  env: arith_env.py\n  args:\n    kind: tool\nsft:\n  steps: 0\n")
    cfg = load_config(str(recipe), [])
    assert cfg.task["env"] == str(env_file)
    with pytest.raises(ConfigError, match=r"task: task.env .*: load_environment\(\*\*task.args\) failed"):
        load_config(str(recipe), ["task.args.oops=1"])
    with pytest.raises(ConfigError, match="leave agent.fn unset"):
        load_config(str(recipe), ["agent.fn=tests.agent_fns:answer"])


def test_flash_data_shows_the_first_request_as_the_engine_receives_it(tmp_path, env_file):
    """The preview of a tool environment is the chat the gateway renders with the task's template
    (flash.envs.agents.TOOL_TEMPLATE): the tools' names, the row's question as the user's turn,
    then the assistant's header; not the question's bare text."""
    from flash.app.data_preview import preview

    recipe = tmp_path / "r.yaml"
    recipe.write_text("task:\n  name: verifiers\n  env: arith_env.py\n  args:\n    kind: tool\nsft:\n  steps: 0\n")
    lines: list[str] = []
    preview(load_config(str(recipe), []), rows=8, out=lines.append)
    task = VerifiersTask(VerifiersOptions(env=str(env_file), args={"kind": "tool"}))
    assert lines[1] == f"<bos>tools: add. q: {task.item(0).prompt} a: "  # the row the run's first item reads
    tokenizer = build_tokenizer()
    tokenizer.chat_template = VerifiersTask.chat_template
    ids = tokenizer.encode(lines[1], add_special_tokens=False)
    assert tokenizer.decode(ids) == lines[1]
    assert lines[0] == f"--- data index 0 ({len(ids)} tokens; its episodes scored whole) ---"


def test_items_come_from_the_dataset_in_a_reshuffled_order_each_pass(env_file):
    task = VerifiersTask(VerifiersOptions(env=str(env_file), args={"kind": "single"}, eval_size=5))
    first = [task.item(i).prompt for i in range(25)]
    second = [task.item(i).prompt for i in range(25, 50)]
    assert sorted(first) == sorted(second) == sorted(f"{a}+{b}=" for a in range(1, 6) for b in range(1, 6))
    assert first != second and first == [task.item(i).prompt for i in range(25)]
    assert [it.prompt for it in task.eval_items()] == ["1+1=", "1+2=", "1+3=", "1+4=", "1+5="]
    assert task.item(3, "eval").answer == "5"


def scripted_gateway(replies: list[str]):
    """A gateway over the tiny model's tokenizer whose policy writes ``replies`` in turn."""
    tok = build_tokenizer(DEFAULT_ALPHABET + VerifiersTask.extra_chars)
    tok.chat_template = VerifiersTask.chat_template
    sampled: list[list[int]] = []

    def generate(prompt_ids, params, key):
        ids = tok.encode(replies[len(sampled) % len(replies)], add_special_tokens=False) + [tok.eos_token_id]
        sampled.append(ids)
        return GenerationOutput("t", list(prompt_ids), ids, [-0.25] * len(ids), [0] * len(ids), "stop")

    return tok, Gateway(tok, generate, max_tokens_cap=64), sampled


CALL = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'


@pytest.mark.parametrize(
    "kind, replies, reward, facts",
    [
        ("single", ["7"], 1.0, {"num_turns": 1.0}),
        ("single", ["71"], 0.02, {"num_turns": 1.0}),
        ("multi", ["9", "7"], 1.0, {"num_turns": 2.0}),
        ("tool", [CALL, "7"], 1.0, {"total_tool_calls": 1.0, "add_calls": 1.0}),
        ("tool", ["8"], 0.01, {"total_tool_calls": 0.0}),
    ],
)
def test_each_kind_of_environment_runs_through_the_gateway_scored_by_its_rubric(
    env_file, tmp_path, kind, replies, reward, facts
):
    """A rollout of item "3+4=" on one gateway session: the rubric's reward and metrics come back
    as the episode's, and the session's sample holds each sampled token once, trained, with its
    logprob; the tool's result (7) is context, not trained."""
    log = tmp_path / "scores.jsonl"
    task = VerifiersTask(VerifiersOptions(env=str(env_file), args={"kind": kind, "log": str(log)}))
    index = next(i for i in range(25) if task.item(i).prompt == "3+4=")
    tok, gateway, sampled = scripted_gateway(replies)
    with gateway as gw:
        key = gw.open_session()

        async def episode():
            import openai

            return await task.agent(openai.AsyncOpenAI(base_url=gw.url, api_key=key, max_retries=0), task.item(index))

        got, info = asyncio.run(episode())
        record = gw.close_session(key)
    assert got == pytest.approx(reward) and [json.loads(x)["reward"] for x in log.read_text().splitlines()] == [got]
    assert {k: info[k] for k in facts} == facts and info["score"] == pytest.approx(reward)
    assert info["truncated"] == 0.0 and info["aborted"] == 0.0
    assert clean_facts(info)[0] == info  # every entry a fact: numbers under safe names
    sample = session_sample(record, prompt_id=0, sample_index=0, admitted_version=0, reward=got, outcome="ok", meta={})
    trained = [t for t, m in zip(sample.response_ids, sample.loss_mask) if m]
    assert trained == [t for ids in sampled for t in ids] and sample.reward == got
    assert [lp for lp, m in zip(sample.behav_logprobs, sample.loss_mask) if m] == [-0.25] * len(trained)
    if kind == "tool" and len(replies) == 2:
        context = tok.decode([t for t, m in zip(sample.response_ids, sample.loss_mask) if not m])
        assert "r: 7" in context  # the environment ran the tool; its result is context


def test_an_empty_reply_aborts_the_rollout_counted_as_a_fact_and_logged_once(env_file, tmp_path):
    """verifiers ends a rollout whose reply is empty on its ``has_error`` stop: the episode reports
    ``aborted`` 1 (``agent/aborted`` averages it per step), and of three such rollouts only the
    first is logged (read by a handler on the environment's own logger: verifiers' loggers do not
    propagate to the root)."""
    import logging

    task = VerifiersTask(VerifiersOptions(env=str(env_file), args={"kind": "tool"}))
    _, gateway, _ = scripted_gateway([""])
    infos, records = [], []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    task.env.logger.addHandler(handler)
    with gateway as gw:
        for i in range(3):
            key = gw.open_session()

            async def episode(key=key, i=i):
                import openai

                return await task.agent(openai.AsyncOpenAI(base_url=gw.url, api_key=key, max_retries=0), task.item(i))

            infos.append(asyncio.run(episode()))
            gw.close_session(key)
    task.env.logger.removeHandler(handler)
    assert [(reward, info["aborted"]) for reward, info in infos] == [(0.0, 1.0)] * 3
    aborted = [r.getMessage() for r in records if r.getMessage().startswith("Aborted rollout")]
    assert len(aborted) == 1 and "counted in agent/aborted" in aborted[0]
    # the environment class's logger is shared: a second task's filter replaces the first's
    again = VerifiersTask(VerifiersOptions(env=str(env_file), args={"kind": "tool"}))
    assert again.env.logger is task.env.logger
    assert sum(type(f).__name__ == "_AbortedOnce" for f in task.env.logger.filters) == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind",
    [  # each kind's rollouts through a real gateway are the fast tests above
        pytest.param("single", marks=pytest.mark.margin),
        pytest.param("multi", marks=pytest.mark.margin),
        "tool",
    ],
)
def test_flash_run_trains_each_kind_of_environment_with_its_rubric(tmp_path, env_file, warm_cache, kind):
    """Two steps of ``flash run`` on the random tiny model: every planned sample is trained, each
    with the reward the rubric computed for it (the rubric's log holds every score)."""
    log, run_dir = tmp_path / "scores.jsonl", tmp_path / "run"
    recipe = tmp_path / "vf.yaml"
    recipe.write_text(
        f"task:\n  name: verifiers\n  env: arith_env.py\n  eval_size: 4\n  args:\n    kind: {kind}\n    log: {log}\n"
    )
    steps, b, n = 2, 2, 2
    finish(
        launch(
            run_dir,
            warm_cache,
            [
                f"run_dir={run_dir}",
                "sft.steps=0",
                "sft.eval_after=false",
                "model.tiny.num_layers=1",
                f"train.prompts_per_step={b}",
                f"rollout.n={n}",
                "rollout.max_new_tokens=8",
                f"train.steps={steps}",
                "tracking.progress=false",
                "tracking.tensorboard=false",
                "tracking.log_samples=64",
                "ray.num_cpus=2",
                "resources.engine_threads=1",
                "resources.trainer_threads=1",
                "checkpoint.every_steps=0",
                "async_ratio=0",
            ],
            recipe=str(recipe),
            base=[],
        ),
        run_dir,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and summary["samples_trained"] == steps * b * n
    scores = [json.loads(line)["reward"] for line in log.read_text().splitlines()]
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert len(samples) == steps * b * n
    assert all(any(s["reward"] == pytest.approx(r) for r in scores) for s in samples)
    if kind == "tool":
        assert all("tools: add." in s["prompt"] for s in samples), samples[0]["prompt"]
    last = read_jsonl(run_dir / "metrics.jsonl")[-1]
    assert last["agent/ok"] >= steps * b * n and last["agent/crashed"] == 0 and last["gateway/new_segments"] == 0
