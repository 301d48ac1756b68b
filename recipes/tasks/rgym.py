"""``reasoning_gym``: a dataset of the reasoning-gym library, generated on the fly and scored by it.

``task.dataset`` names one of reasoning-gym's procedural datasets (``chain_sum``,
``basic_arithmetic``, ``leg_counting``, ...) and ``task.options`` are its configuration (passed to
``reasoning_gym.create_dataset``). Item ``i`` of the train split is the dataset's entry ``i``
generated with seed ``seed``; the eval split is a second dataset generated with another seed (items
can coincide when the dataset's space is small). Nothing is read from files. The reward is the
dataset's own ``score_answer(response, entry)`` (a number in [0, 1]); the warm start's
demonstrations are the entries' answers, an integer one too high with probability ``slip_prob``.

The tiny CPU model's tokenizer is byte level: any dataset's prompts fit it (``lowercase: true``
lowercases prompts and answers, for a model trained on lower case).

Supported: reasoning-gym 0.1.x (tested with 0.1.25).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from flash.tasks import Task, TaskItem, register_task

INSTALL = "pip install 'flash-rl[reasoning-gym]' (reasoning-gym 0.1.x)"
EVAL_SEED_OFFSET = 1_000_003  # the eval dataset's seed: seed + this


@dataclass(frozen=True)
class ReasoningGymOptions:
    """Options of ``reasoning_gym`` (the keys a recipe's ``task:`` block accepts)."""

    dataset: str = ""  # a reasoning-gym dataset name
    options: dict = field(default_factory=dict)  # its configuration (reasoning_gym.create_dataset)
    seed: int = 0
    size: int = 1_000_000  # train items before the stream repeats
    eval_size: int = 64
    lowercase: bool = False  # prompts and answers in lower case (a tokenizer without capitals)
    slip_prob: float = 0.0  # a demonstration's integer answer is one too high with this probability (room for RL)

    def __post_init__(self) -> None:
        if not isinstance(self.dataset, str) or not self.dataset:
            raise ValueError("task.dataset names a reasoning-gym dataset, e.g. chain_sum")
        if not isinstance(self.options, dict) or any(not isinstance(k, str) for k in self.options):
            raise ValueError(f"task.options is the dataset's configuration: a mapping, got {self.options!r}")
        reserved = {"seed", "size"} & set(self.options)
        if reserved:
            raise ValueError(f"task.options sets {sorted(reserved)}: set task.seed / task.size instead")
        if not 0.0 <= self.slip_prob < 1.0:
            raise ValueError(f"slip_prob must be in [0, 1), got {self.slip_prob}")
        if self.size < 1 or self.eval_size < 1:
            raise ValueError(f"size and eval_size must be >= 1, got {self.size}, {self.eval_size}")


def create(options: ReasoningGymOptions, split: str):
    """The reasoning-gym dataset of ``split`` (ValueError naming the fix for an unknown name or
    configuration, or a missing library)."""
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ValueError(f"task.name reasoning_gym needs the reasoning-gym library: {INSTALL}") from None
    if options.dataset not in DATASETS:
        from flash.algos.registry import did_you_mean

        raise ValueError(
            f"task.dataset {options.dataset!r} is not a reasoning-gym dataset"
            f"{did_you_mean(options.dataset, sorted(DATASETS), n=1)}"
        )
    seed = options.seed + (EVAL_SEED_OFFSET if split == "eval" else 0)
    size = options.eval_size if split == "eval" else options.size
    try:
        return reasoning_gym.create_dataset(options.dataset, seed=seed, size=size, **options.options)
    except Exception as exc:  # the library's checks of its configuration (TypeError, AssertionError, ...)
        raise ValueError(f"task.options for {options.dataset}: {type(exc).__name__}: {str(exc)[:300]}") from None


@register_task("reasoning_gym")
class ReasoningGym(Task):
    """A reasoning-gym dataset, scored by its own score_answer (see the module docstring)."""

    Options = ReasoningGymOptions

    @classmethod
    def check(cls, options: ReasoningGymOptions) -> None:
        create(options, "eval")

    def __init__(self, options: ReasoningGymOptions) -> None:
        super().__init__(options)
        self.datasets = {split: create(options, split) for split in ("train", "eval")}

    def entry(self, index: int, split: str) -> dict:
        data = self.datasets[split]
        return data[index % len(data)]

    def _text(self, text: str) -> str:
        return text.lower() if self.options.lowercase else text

    def _make_item(self, index: int, split: str, rng: random.Random) -> TaskItem:
        entry = self.entry(index, split)
        return TaskItem(
            index=index,
            prompt=self._text(entry["question"]),
            answer=self._text(str(entry["answer"])),
            meta={"split": split},
        )

    def max_response_tokens(self) -> int:
        return max(len(self.entry(i, "eval")["answer"]) for i in range(min(16, self.options.eval_size))) + 1

    def reward(self, item: TaskItem, response: str) -> float:
        entry = self.entry(item.index, item.meta.get("split", "train"))
        if self.options.lowercase:
            entry = {**entry, "answer": str(entry["answer"]).lower()}
        return float(self.datasets[item.meta.get("split", "train")].score_answer(response.strip(), entry))

    def sft_pair(self, index: int) -> tuple[str, str]:
        """The entry's answer; with probability ``slip_prob`` an integer answer one too high instead
        (as ``wordproblems`` slips: a bias the warm start learns and the reward teaches away)."""
        item = self.item(index, "train")
        answer = item.answer
        rng = self.rng(index, "train", stream="demo")
        if self.options.slip_prob and rng.random() < self.options.slip_prob and re.fullmatch(r"-?\d+", answer.strip()):
            answer = str(int(answer) + 1)
        return item.prompt, answer
