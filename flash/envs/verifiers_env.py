"""``verifiers`` environments as tasks: ``task.name: verifiers``, run unchanged through the gateway.

An environment written for the ``verifiers`` library (its classic API: ``vf.SingleTurnEnv``,
``vf.MultiTurnEnv``, ``vf.ToolEnv`` and their subclasses, as on the Environments Hub) is a module
with ``load_environment(**kwargs) -> vf.Environment``. ``task.env`` names the module (importable,
or a ``.py`` file beside the recipe) and ``task.args`` are the keyword arguments of
``load_environment``. What comes from the environment, unchanged:

- the prompts: its dataset (``get_dataset``: train items, in a reshuffled order each pass) and its
  eval dataset (``get_eval_dataset``, the dataset where it has none: the first ``eval_size`` rows);
- the rollout loop: each episode is one ``env.run_rollout`` call (turns, tool calls, the
  environment's replies, its stop conditions) with a verifiers client over the episode's gateway
  session, so every model call is one turn of the episode, trained token for token as sampled
  (flash.envs.gateway, controllers/workflows/agent.py);
- the score: its rubric (``run_rollout`` scores the rollout); the reward is the rubric's weighted
  reward, and the rubric's numeric metrics with ``truncated`` and ``aborted`` are the episode's
  facts (``episode_info``).

So a verifiers task runs as an agent task whose agent is ``VerifiersTask.agent``. Model calls go
through ``VerifiersClient``: verifiers' own OpenAI chat-completions client with the null-valued
message fields (``tool_calls: null``, ``reasoning_content: null``) left out, which is the form the
gateway reads.

Supported: verifiers 0.3.x (its classic API; 0.4 replaced it with ``verifiers.v1``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flash.data.files import datasets_module
from flash.envs.agents import TOOL_TEMPLATE
from flash.envs.demonstrations import DemonstrationError, demonstration_turns
from flash.models import BOS, EOS
from flash.tasks import Task, TaskItem, register_task

MODEL = "policy"  # the model name the rollouts ask for (the gateway serves one policy)
INSTALL = "pip install 'flash-rl[verifiers]' (verifiers 0.3.x)"


@dataclass(frozen=True)
class VerifiersOptions:
    """Options of ``verifiers`` (the keys a recipe's ``task:`` block accepts)."""

    env: str = ""  # the environment module: an importable name, or a .py path (beside the recipe)
    args: dict = field(default_factory=dict)  # keyword arguments of its load_environment
    seed: int = 0  # the order of the train rows
    eval_size: int = 32  # held-out items: the first rows of the eval dataset
    sft_key: str = ""  # the dataset column holding each row's demonstration (the tiny model's warm start)

    def __post_init__(self) -> None:
        if not isinstance(self.env, str) or not self.env:
            raise ValueError("task.env names the verifiers environment: a module name or a .py file beside the recipe")
        if not isinstance(self.args, dict) or any(not isinstance(k, str) for k in self.args):
            raise ValueError(f"task.args are load_environment's keyword arguments: a mapping, got {self.args!r}")
        if self.eval_size < 1:
            raise ValueError(f"eval_size must be >= 1, got {self.eval_size}")
        if not isinstance(self.sft_key, str):
            raise ValueError(f"task.sft_key names a column of the environment's dataset, got {self.sft_key!r}")


def import_environment(env: str):
    """The module ``env`` names (a ``.py`` path or a module name); ValueError naming the fix."""
    try:
        importlib.import_module("verifiers")
    except ImportError:
        raise ValueError(f"task.name verifiers needs the verifiers library: {INSTALL}") from None
    if env.endswith(".py"):
        path = Path(env).expanduser()
        if not path.is_file():
            raise ValueError(f"task.env: no such file {path} (a .py path is relative to the recipe's folder)")
        name = f"flash_vf_env_{path.stem}"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # the user's module: any failure is one line naming it
            del sys.modules[name]
            raise ValueError(f"task.env {env!r}: importing it failed: {type(exc).__name__}: {exc}") from None
        return module
    try:
        return importlib.import_module(env.replace("-", "_"))
    except ImportError as exc:
        raise ValueError(
            f"task.env {env!r}: cannot import it ({exc}); put {env}.py beside the recipe, name its "
            f".py path, or install the environment's package (pip install {env})"
        ) from None


def load_environment(env: str, args: dict):
    """``load_environment(**args)`` of module ``env``: a verifiers ``Environment`` (ValueError naming
    the fix for a module without one, a call that fails, or something else returned)."""
    module = import_environment(env)
    fn = getattr(module, "load_environment", None)
    if not callable(fn):
        raise ValueError(
            f"task.env {env!r} has no load_environment function: a verifiers environment module "
            "defines 'def load_environment(**kwargs) -> vf.Environment'"
        )
    try:
        datasets_module()  # offline, and no progress bars when the environment maps its dataset
        environment = fn(**args)
    except Exception as exc:  # the user's code
        raise ValueError(
            f"task.env {env!r}: load_environment(**task.args) failed: {type(exc).__name__}: "
            f"{str(exc)[:300]} (check task.args)"
        ) from None
    from verifiers.legacy.envs.environment import Environment

    if not isinstance(environment, Environment):
        raise ValueError(
            f"task.env {env!r}: load_environment returned a {type(environment).__name__}, not a "
            f"verifiers Environment (the classic API: vf.SingleTurnEnv, vf.MultiTurnEnv, vf.ToolEnv)"
        )
    return environment


def plain_rows(dataset) -> list[dict]:
    """A verifiers dataset's rows as dicts (the rollout inputs)."""
    return [dict(row) for row in dataset] if dataset is not None else []


def prompt_text(prompt: Any) -> str:
    """The last user message's text of a chat prompt (a completion prompt as it is), for display."""
    if isinstance(prompt, str):
        return prompt
    users = [m for m in prompt or [] if isinstance(m, dict) and m.get("role") == "user"]
    content = users[-1].get("content", "") if users else ""
    return content if isinstance(content, str) else str(content)


def episode_info(output: dict) -> dict:
    """The facts of one rollout (numbers: flash.buffers facts): the rubric's numeric metrics (each
    reward function's score, a multi-turn environment's ``num_turns``, a tool environment's
    ``total_tool_calls``), ``truncated`` and ``aborted`` (the rollout ended on an error, e.g. an
    empty reply: verifiers' ``has_error`` stop), each 0 or 1."""
    metrics = {
        k: float(v)
        for k, v in (output.get("metrics") or {}).items()
        if isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    return {
        **metrics,
        "truncated": float(bool(output.get("is_truncated"))),
        "aborted": float(bool(output.get("error"))),
    }


class _AbortedOnce(logging.Filter):
    """Lets the first of an environment's "Aborted rollout" errors through, with a note; the rest
    are counted (``agent/aborted``), not logged."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Aborted rollout"):
            return True
        self.seen += 1
        if self.seen == 1:
            record.msg = f"{record.msg} (further aborted rollouts are counted in agent/aborted, not logged)"
        return self.seen == 1


@register_task("verifiers")
class VerifiersTask(Task):
    """An environment of the verifiers library, run unchanged (see the module docstring)."""

    Options = VerifiersOptions
    chat_template = TOOL_TEMPLATE  # a system message renders as a "q:" turn

    def __init__(self, options: VerifiersOptions) -> None:
        super().__init__(options)
        self.env = load_environment(options.env, dict(options.args))
        logger = getattr(self.env, "logger", None)  # one per environment class: this task's filter replaces any
        if isinstance(logger, logging.Logger):
            for old in [f for f in logger.filters if isinstance(f, _AbortedOnce)]:
                logger.removeFilter(old)
            logger.addFilter(_AbortedOnce())
        self.rows = {"train": plain_rows(self.env.get_dataset()), "eval": plain_rows(self.env.get_eval_dataset())}
        if not self.rows["train"]:
            raise ValueError(
                f"task.env {options.env!r}: its environment has no dataset (load_environment must pass "
                "dataset= to the environment)"
            )
        self._orders: dict[int, list[int]] = {}

    @classmethod
    def check(cls, options: VerifiersOptions) -> None:
        load_environment(options.env, dict(options.args))

    def row_index(self, index: int, split: str) -> int:
        n = len(self.rows[split])
        if split == "eval":
            return index % n
        epoch, pos = divmod(index, n)
        if epoch not in self._orders:
            order = list(range(n))
            random.Random(f"{self.options.seed}|{epoch}").shuffle(order)
            self._orders[epoch] = order
        return self._orders[epoch][pos]

    def _make_item(self, index: int, split: str, rng: random.Random) -> TaskItem:
        row_index = self.row_index(index, split)
        row = self.rows[split][row_index]
        answer = row.get("answer")
        return TaskItem(
            index=index,
            prompt=prompt_text(row.get("prompt")),
            answer=answer if isinstance(answer, str) else "",
            meta={"split": split, "row": row_index},
        )

    def first_request(self, item: TaskItem) -> dict | str:
        """The prompt of the item's first chat request as the gateway receives it: the row's
        messages with the environment's tools (a completion environment's text as it is)."""
        prompt = self.rows[item.meta["split"]][item.meta["row"]].get("prompt")
        if isinstance(prompt, str):
            return prompt
        return {"messages": [{k: v for k, v in m.items() if v is not None} for m in prompt or []], "tools": self.tools}

    def eval_items(self) -> list[TaskItem]:
        return [self.item(i, "eval") for i in range(min(self.options.eval_size, len(self.rows["eval"])))]

    def max_response_tokens(self) -> int:
        return 64

    def reward(self, item: TaskItem, response: str) -> float:
        raise NotImplementedError("a verifiers environment scores whole rollouts with its rubric (VerifiersTask.agent)")

    def sft_pair(self, index: int) -> tuple[dict, str]:
        """One assistant turn of train row ``index``'s demonstration (the ``task.sft_key`` column),
        with the chat before it (flash.envs.demonstrations)."""
        if not self.options.sft_key:
            raise ValueError(
                "a verifiers environment's rows hold no demonstrations unless task.sft_key names the "
                "column that does; or start from a model (model.path), or set sft.steps=0"
            )
        row_index = self.row_index(index, "train")
        row = self.rows["train"][row_index]
        if self.options.sft_key not in row:
            raise ValueError(
                f"task.sft_key {self.options.sft_key!r}: the environment's dataset has no such column "
                f"(its columns: {', '.join(sorted(row))})"
            )
        try:
            turns = demonstration_turns(
                row.get("prompt"), row[self.options.sft_key], self.tools, self.chat_template, BOS, EOS
            )
        except DemonstrationError as exc:
            raise ValueError(f"task.sft_key {self.options.sft_key!r}, row {row_index}: {exc}") from None
        return turns[self.rng(index, "train", stream="demo").randrange(len(turns))]

    @property
    def tools(self) -> list[dict] | None:
        """The environment's tools as a chat request carries them (OpenAI function schemas)."""
        defs = getattr(self.env, "tool_defs", None) or []
        return [
            {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
            for t in defs
        ] or None

    @property
    def data_fingerprint(self) -> str:
        """The rows and tools the warm start reads (the cache key changes when they do)."""
        blob = json.dumps([self.rows["train"], self.tools], sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()

    async def agent(self, client, item: TaskItem) -> tuple[float, dict]:
        """One episode: the environment's rollout on the item's row over ``client`` (an
        ``openai.AsyncOpenAI`` on the episode's gateway session), scored by its rubric."""
        row = self.rows[item.meta["split"]][item.meta["row"]]
        output = await self.env.run_rollout(
            dict(row), VerifiersClient.over(client), MODEL, dict(self.env.sampling_args or {})
        )
        return output.get("reward") or 0.0, episode_info(output)


class VerifiersClient:
    """verifiers' chat-completions client over the gateway (built on first use: the class derives
    from the optional library's)."""

    _cls = None

    @classmethod
    def over(cls, client):
        if cls._cls is None:
            from verifiers.legacy.clients.openai_chat_completions_client import OpenAIChatCompletionsClient

            class _Client(OpenAIChatCompletionsClient):
                async def to_native_prompt(self, messages):
                    native, extra = await super().to_native_prompt(messages)
                    return [{k: v for k, v in dict(m).items() if v is not None} for m in native], extra

            cls._cls = _Client
        return cls._cls(client)
