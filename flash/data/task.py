"""``dataset``: a task over the user's own rows (local JSONL/JSON, CSV, Parquet, save_to_disk).

A recipe names its files under ``data:`` (``flash.app.config.task_section`` turns that block into
this task's options); the rows are read through Hugging Face ``datasets`` and stay memory-mapped.

Order: the train stream is the train rows epoch after epoch; each epoch is a permutation drawn from
(seed, epoch) alone, so data position ``i`` always names the same row: ``divmod(i, rows)`` is
(epoch, place in that epoch's order). A run's data position is in its checkpoints, so a resumed
run continues the epoch where it stopped and trains every row of it exactly once.

Held out: rows of ``eval`` files, else ``holdout`` train rows (at most a tenth of them) picked by
the seed and never trained on. Rewards: ``reward`` (default ``math``) for every row, or the row's own
``reward_key`` column naming one. A row chooses only among names: a registered reward (``math``,
``code``, ``judge``, ...) or one the recipe lists in ``rewards`` (``{name: "package.module:function"
or a registered name}``; a listed import path may be named as itself too). Any other text, an
import path included, makes the row bad (``bad_reward_name``) and is never looked up or imported.
A row whose reference the ``math`` reward cannot parse is a bad row (``bad_answer``), as is one
over ``flash.rewards.math_limits``' bounds or deadline (``answer_too_large``, ``answer_too_deep``,
``answer_timeout``); the task's own ``math`` reward runs under that deadline too.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from flash.data.files import content_hash, open_rows
from flash.data.rows import OWN_META, BadRow, RowSpec, parse_template, checked_reward_name, row_item
from flash.tasks import Task, TaskItem, register_task

log = logging.getLogger("flash")


@dataclass(frozen=True)
class DatasetOptions:
    """Options of ``dataset`` (filled from a recipe's ``data:`` block)."""

    train: tuple = ()  # local files / save_to_disk directories, read in order
    eval: tuple = ()  # held-out files; empty: hold out `holdout` train rows
    holdout: int = 64  # at most a tenth of the rows
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    system_prompt: str | None = None
    template: str | None = None
    reward_key: str | None = None
    reward: str = "math"  # the reward of a row without a reward_key column
    rewards: tuple = ()  # the rewards a reward_key column may name besides the registered ones: {name: target}
    sft_key: str | None = None  # a demonstration column: the tiny model's warm start
    shuffle: bool = True
    seed: int = 0
    eval_size: int = 256  # held-out items evaluated (at most)

    def __post_init__(self) -> None:
        object.__setattr__(self, "train", tuple(self.train))
        object.__setattr__(self, "eval", tuple(self.eval))
        object.__setattr__(self, "rewards", listed_rewards(self.rewards))
        if self.holdout < 0 or self.eval_size < 1:
            raise ValueError(f"holdout must be >= 0 and eval_size >= 1, got {self.holdout}, {self.eval_size}")
        if self.template is not None:
            parse_template(self.template)  # refused here too, before any row is read

    @property
    def spec(self) -> RowSpec:
        return RowSpec(self.prompt_key, self.answer_key, self.system_prompt, self.template, self.reward_key)


MAX_REWARD_NAME = 200  # characters of a name or target in data.rewards


def listed_rewards(rewards) -> tuple[tuple[str, str], ...]:
    """``data.rewards`` (a mapping, or its ``(name, target)`` pairs) as sorted pairs; ValueError
    naming the fix for a name or target that is not short non-empty text."""
    pairs = rewards.items() if hasattr(rewards, "items") else rewards
    out = []
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(
                f"data.rewards maps names to rewards, e.g. {{exact: 'my_pkg.rewards:exact'}}; got {pair!r}"
            )
        for text in pair:
            if not isinstance(text, str) or not text.strip() or len(text) > MAX_REWARD_NAME:
                raise ValueError(
                    f"data.rewards: {str(text)[:80]!r} must be a non-empty name of at most "
                    f"{MAX_REWARD_NAME} characters: {{name: 'package.module:function' or a reward name}}"
                )
        out.append((pair[0], pair[1]))
    return tuple(sorted(out))


def _permutation(seed: int, stream: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, stream]).permutation(n)


@register_task("dataset")
class DatasetTask(Task):
    """Rows of local dataset files (see the module docstring)."""

    Options = DatasetOptions

    def __init__(self, options: DatasetOptions) -> None:
        super().__init__(options)
        self.read_skipped: Counter = Counter()  # train rows skipped before the reader, by reason
        self._rows = open_rows(options.train, skipped=self.read_skipped)
        eval_skipped: Counter = Counter()
        self._eval_rows = open_rows(options.eval, "data.eval", eval_skipped) if options.eval else None
        for where, skipped in (("data.train", self.read_skipped), ("data.eval", eval_skipped)):
            if skipped:
                log.warning(
                    "flash: %s: rows skipped before reading (over flash.data.limits' bounds): %s", where, dict(skipped)
                )
        self.train_ids, self.eval_ids = self._split(len(self._rows))
        if len(self.train_ids) == 0:
            raise ValueError(f"data.train has no rows ({', '.join(options.train)})")
        self._order_cache: tuple[int, np.ndarray] | None = None
        self._scorers: dict = {}
        _warn_hidden_columns(self.columns() + (self.columns("eval") if self._eval_rows is not None else []))

    def _split(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if self._eval_rows is not None or not self.options.holdout:
            eval_ids = np.arange(len(self._eval_rows)) if self._eval_rows is not None else np.arange(0)
            return np.arange(n), eval_ids
        held = _permutation(self.options.seed, 2**32 - 1, n)[: min(self.options.holdout, n // 10)]
        mask = np.ones(n, dtype=bool)
        mask[held] = False
        return np.nonzero(mask)[0], np.sort(held)

    def columns(self, split: str = "train") -> list[str]:
        rows = self._eval_rows if split == "eval" and self._eval_rows is not None else self._rows
        return list(rows.column_names)

    @property
    def rows_per_epoch(self) -> int:
        return len(self.train_ids)

    def _order(self, epoch: int) -> np.ndarray:
        if self._order_cache is None or self._order_cache[0] != epoch:
            n = self.rows_per_epoch
            order = _permutation(self.options.seed, epoch, n) if self.options.shuffle else np.arange(n)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def position(self, index: int) -> tuple[int, int]:
        """(epoch, row number in the train files) of data position ``index``."""
        epoch, place = divmod(index, self.rows_per_epoch)
        return epoch, int(self.train_ids[self._order(epoch)[place]])

    def item(self, index: int, split: str = "train") -> TaskItem:
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        if split == "train":
            epoch, row = self.position(index)
            source, meta = self._rows, {"row": row, "epoch": epoch, "split": "train"}
        elif split == "eval":
            row = int(self.eval_ids[index])
            source = self._eval_rows if self._eval_rows is not None else self._rows
            meta = {"row": row, "split": "eval"}
        else:
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        item = row_item(source[row], self._spec, index, meta)
        self._check_reference(item)
        return item

    @cached_property
    def _spec(self) -> RowSpec:
        """The row spec, with the names a ``reward_key`` column may hold when one is set."""
        spec = self.options.spec
        if spec.reward_key is None:
            return spec
        from flash.rewards.registry import registered_rewards

        listed = {n for pair in self.options.rewards for n in pair}
        names = {n for n in registered_rewards() if ":" not in n} | listed
        return replace(spec, reward_names=frozenset(names))

    def _reward_name(self, item: TaskItem) -> str:
        """The reward ``item`` is scored by, as ``build_reward`` takes it: a row's name only when
        the recipe allows it (``BadRow`` ``bad_reward_name`` otherwise, never looked up), through
        ``data.rewards``."""
        name = self.options.reward
        if self.options.reward_key is not None and "reward_fn" in item.meta:
            name = checked_reward_name(item.meta["reward_fn"], self._spec.reward_names, "item.meta['reward_fn']")
        return dict(self.options.rewards).get(name, name)

    def _check_reference(self, item: TaskItem) -> None:
        """A ``math`` row's reference must parse, within math_limits' bounds and deadline: else
        the row is bad (``bad_answer``, ``answer_too_large``, ``answer_too_deep``, ``answer_timeout``)."""
        if self._reward_name(item) == "math":
            from flash.rewards.math_limits import MathTooComplex, check_math_text, checker
            from flash.rewards.builtin import reference_answer

            try:
                check_math_text(reference_answer(item.answer))
                checker().call("parse", item.answer)
            except MathTooComplex as exc:
                raise BadRow(f"answer_{exc.reason}", str(exc)) from None
            except ValueError as exc:
                raise BadRow("bad_answer", str(exc)) from None

    def eval_items(self) -> list[TaskItem]:
        """Up to ``eval_size`` held-out rows; bad ones are left out (counted in a warning)."""
        items, bad = [], Counter()
        for i in range(min(self.options.eval_size, len(self.eval_ids))):
            try:
                items.append(self.item(i, "eval"))
            except BadRow as exc:
                bad[exc.reason] += 1
        if bad:
            log.warning("flash: held-out rows left out of evaluation: %s", dict(bad))
        if not items:
            raise ValueError("no usable held-out rows: set data.eval to a file or data.holdout > 0")
        return items

    def reward(self, item: TaskItem, response: str) -> float:
        """The row's reward (``reward_key``) or the task's, built once per name. A reward function
        may return a ``RewardResult``; a task's reward is its number (the scheduler takes ``float``
        of it, and a ``RewardResult`` there would be a reward error scored 0)."""
        name = self._reward_name(item)
        if name == "math":  # in the driver's threads: under math_limits' deadline, in its child process
            from flash.rewards.math_limits import checker

            return checker().call("score", item.answer, response)
        if name not in self._scorers:
            from flash.rewards.registry import build_reward

            self._scorers[name] = build_reward({"name": name})
        value = self._scorers[name](item, response)
        return value if isinstance(value, (int, float)) else _number(value)

    def sft_pair(self, index: int) -> tuple[str, str]:
        if not self.options.sft_key:
            raise ValueError(
                "the tiny model's warm start needs demonstrations: set data.sft_key to a "
                "column holding them, or start from a model (model.path)"
            )
        item = self.item(index, "train")
        if self.options.sft_key == self.options.answer_key:  # the reference column is the demonstration
            return item.prompt, item.answer
        return item.prompt, str(item.meta[self.options.sft_key])

    def max_response_tokens(self) -> int:
        return 64

    @cached_property
    def data_fingerprint(self) -> str:
        """The rows' identity for caches: file contents, not paths."""
        return content_hash(self.options.train + self.options.eval)


def _warn_hidden_columns(columns: list[str]) -> None:
    """Columns that flash's own item fields replace (``rows.OWN_META``) are named once: a reward
    reading ``item.meta['split']`` gets flash's split, not the file's."""
    hidden = sorted(set(columns) & set(OWN_META))
    if hidden:
        log.warning(
            "flash: dataset column(s) %s are replaced in item.meta by flash's own (%s); rename them to "
            "keep their values",
            ", ".join(hidden),
            ", ".join(f"{k}: {v}" for k, v in OWN_META.items() if k in hidden),
        )


def _number(value) -> float:
    """The reward of a scorer's ``RewardResult``; anything else is left for the caller's ``float``."""
    from flash.rewards import RewardResult

    return value.reward if isinstance(value, RewardResult) else value
