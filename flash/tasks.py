"""What a task is: a deterministic stream of prompts, a verifiable reward, and SFT demonstrations.

A task is the smallest unit a recipe names. It owns no model and no tokenizer: prompts and
responses are text, and the reward is a pure function of the item and the response text, so the
reward workers, the engines and the trainer can all be swapped without touching it.

Determinism: ``item(index, split)`` depends only on the task's options (its seed included), the
split and the index. Train and eval items come from separate random streams, so held-out accuracy
is measured on prompts the policy was not trained on (short items can still coincide by chance
when the space of prompts is small; a task documents this if it matters).

Options: each task declares a frozen dataclass of options. ``make_task(name, **options)`` rejects
an unknown option with an error naming the closest valid one (docs/design.md invariant 6), and
``task_options(name)`` hands the dataclass to the config layer so it can validate YAML before
anything runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import random
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Literal

from flash.algos.registry import Registry

Split = Literal["train", "eval"]
SPLITS: tuple[str, ...] = ("train", "eval")


@dataclass(frozen=True)
class TaskItem:
    """One prompt of a task. ``answer`` is the reference the reward checks against; ``meta``
    holds task-specific facts (e.g. operands, expected response length) for metrics and tests."""

    index: int
    prompt: str
    answer: str
    meta: dict = field(default_factory=dict)


class Task:
    """Base class of every task. Subclasses set ``name`` and ``Options`` and implement
    ``_make_item``, ``reward`` and ``sft_pair``; ``item`` handles seeding and splits."""

    name: ClassVar[str] = ""
    Options: ClassVar[type] = type(None)
    # The tiny warm start's byte tokenizer reads any text: ``extra_chars`` is accepted and
    # ignored. ``chat_template`` replaces that tokenizer's own template when the task's
    # demonstrations are chats (flash.train.sft.task_tokenizer).
    extra_chars: ClassVar[str] = ""
    chat_template: ClassVar[str | None] = None
    # Options that change how items are served, not what they are (workers, injected latency):
    # left out of ``task_fingerprint``, so they do not retrain a cached warm start.
    runtime_options: ClassVar[tuple[str, ...]] = ()
    # A task whose episodes are agent runs through the gateway defines ``async def agent(self,
    # client, item) -> reward | (reward, info)`` (flash.envs.agents), used where ``agent.fn`` is unset.
    agent: ClassVar[Callable | None] = None
    # Such a task may also define ``first_request(item) -> str | dict`` (a prompt, or a chat's
    # ``{"messages", "tools"}``): what its agent first sends, which ``flash data`` shows.

    @classmethod
    def check(cls, options) -> None:
        """What ``flash validate`` checks of these options beyond their own ranges (ValueError
        naming the fix); a task over outside code loads it here."""

    def __init__(self, options) -> None:
        self.options = options

    def rng(self, index: int, split: str, stream: str = "item") -> random.Random:
        """A ``random.Random`` seeded from (task name, seed, split, stream, index) through a hash,
        so neighbouring indices and the two splits give unrelated streams."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        seed = getattr(self.options, "seed", 0)
        key = f"{self.name}|{seed}|{split}|{stream}|{index}".encode()
        return random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))

    def item(self, index: int, split: Split = "train") -> TaskItem:
        """The ``index``-th prompt of ``split``; the same arguments always give the same item."""
        return self._make_item(index, split, self.rng(index, split))

    def eval_items(self) -> list[TaskItem]:
        """The held-out set: ``options.eval_size`` items of the eval split."""
        return [self.item(i, "eval") for i in range(self.options.eval_size)]

    def max_response_tokens(self) -> int:
        """Longest correct response in tokens of the tiny model's byte tokenizer (one per byte,
        plus ``<eos>``): what an engine's ``max_new_tokens`` should allow."""
        return 64

    def _make_item(self, index: int, split: str, rng: random.Random) -> TaskItem:
        raise NotImplementedError

    def reward(self, item: TaskItem, response: str) -> float:
        """1.0 if ``response`` solves ``item``, else 0.0. Pure and cheap: reward workers call it."""
        raise NotImplementedError

    def sft_pair(self, index: int) -> tuple[str, str]:
        """(prompt, response) for supervised warm start on train item ``index``. A task may make
        these deliberately imperfect so that RL has something left to learn (see its docstring)."""
        raise NotImplementedError


# The built-in tasks (``flash.recipes.tasks``, the content layer) register on the first lookup, imported
# by name: the contract never imports its instances.
TASKS = Registry("task", builtins=("flash.recipes.tasks",))


def register_task(name: str) -> Callable[[type[Task]], type[Task]]:
    """Class decorator: ``@register_task("chainsum")`` makes the task available to ``make_task``."""

    def wrap(cls: type[Task]) -> type[Task]:
        if not dataclasses.is_dataclass(cls.Options):
            raise TypeError(f"{cls.__name__}.Options must be a dataclass")
        TASKS.register(name, (inspect.getdoc(cls) or "").split("\n")[0])(cls)
        cls.name = name
        return cls

    return wrap


def registered_tasks() -> list[str]:
    return TASKS.names()


def task_options(name: str) -> type:
    """The options dataclass of task ``name`` (for config validation)."""
    return task_class(name).Options


def task_class(name: str) -> type[Task]:
    """The class of task ``name`` (its options, its checks, whether it runs agents)."""
    return TASKS.get(name).fn


def make_task(name: str, **options) -> Task:
    """Build task ``name`` with ``options`` (an unknown option raises the closest-name error)."""
    cls = TASKS.check_knobs(name, options, what="option").fn
    return cls(cls.Options(**options))


def task_fingerprint(task: Task) -> dict:
    """Everything that identifies a task's data (for cache keys): its name, all its options and its
    code (``code_fingerprint``); a task over files adds ``data_fingerprint`` (their contents), so a
    copy elsewhere is the same data."""
    options = {k: v for k, v in dataclasses.asdict(task.options).items() if k not in task.runtime_options}
    data = getattr(task, "data_fingerprint", None)
    if data is not None:
        options = {k: v for k, v in options.items() if k not in ("train", "eval")} | {"data": data}
    return {"name": task.name, "options": options, "code": code_fingerprint(type(task))}


def code_fingerprint(cls: type) -> str:
    """A digest of the source files defining ``cls`` and its bases (those with a file), so an edit
    to a task's code (its items, its demonstrations) is a new cache key, not a stale warm start."""
    digest = hashlib.sha256()
    for path in dict.fromkeys(p for p in map(_source_file, cls.__mro__) if p is not None):
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def _source_file(cls: type) -> str | None:
    """The ``.py`` file defining ``cls``, or None (builtins, classes of interactive sessions)."""
    try:
        path = inspect.getfile(cls)
    except (TypeError, OSError):
        return None
    return path if path.endswith(".py") else None
