"""The evaluation: named sets, ``eval.sets``, and the task's own held-out set as one more.

    eval:
      sets: {gsm_dev: path/dev.jsonl, words: {task: wordproblems, max_operand: 9}}
      n: 4          # samples per prompt
      every_steps: 10

The sets are the named ones in config order, then ``eval``: the task's held-out items
(``data.eval`` or the holdout of a dataset, a built-in task's eval split), left out when the task
has none, when a named set is called ``eval``, or when a named set reads the same files as
``data.eval``. The first set's ``mean@n`` is the run's headline held-out accuracy
(``eval/accuracy``, ``summary.json``'s ``eval_accuracy_*``).

A set is dataset files (read with the run's ``data:`` keys: prompt and answer columns, template,
system prompt) or a built-in task's held-out items. Each prompt is sampled ``n`` times through the
same engine as training; per set: ``eval/<name>/mean@n`` (mean fraction of a prompt's samples that
solve it), ``eval/<name>/pass@k`` for k = 1, 2, 4, ... up to n (the unbiased estimator of Chen et
al. 2021, "Evaluating Large Language Models Trained on Code"), ``reward_mean`` and
``response_tokens``. A sample solves its prompt when its reward is >= 1 (a code reward's fraction
of tests passed counts only when all pass). Every generation goes to
``eval/<name>/step-<N>.jsonl`` in the run dir: the whole prompt as the model saw it (special tokens
kept, as in ``samples.jsonl``), the response, the answer, the reward. While an evaluation runs, the
progress bar and the heartbeat show its samples done and the time left, then while a set's samples
are scored, their count scored and the scoring's time left (``eval 64/64 samples, scoring 10/64,
~12s left``).

Scoring: with ``reward.fn`` set the reward workers score every set (the recipe says so); without,
each set's own task scores its items (a built-in task's reward, a dataset's ``reward``/``reward_key``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from math import comb
from pathlib import Path
from typing import Any, Callable

from flash.app.progress import eval_note, scoring_note
from flash.errors import ConfigError
from flash.run_files import open_run_file, run_subdir

MAX_SET_ITEMS = 4096
OWN_SET = "eval"  # the name of the task's own held-out set


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from n, c of them correct, is correct):
    ``1 - C(n - c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 if n - c < k else 1.0 - comb(n - c, k) / comb(n, k)


def ks(n: int) -> list[int]:
    """1, 2, 4, ... below n, and n itself."""
    out, k = [], 1
    while k < n:
        out.append(k)
        k *= 2
    return out + [n]


@dataclass
class EvalSet:
    name: str
    items: list
    rescore: Callable[[Any, str], Any] | None  # the set's own reward, when the task scores


def _set_task(cfg, name: str, spec):
    """The task behind one ``eval.sets`` entry: files through the dataset task, or a built-in."""
    from flash.recipes.tasks import make_task

    from flash.app.data import DATA_OPTIONS

    if isinstance(spec, (str, list)):
        from flash.data.files import check_path

        files = (spec,) if isinstance(spec, str) else tuple(spec)
        for f in files:
            check_path(str(f), f"eval.sets.{name}")
        options = {k: getattr(cfg.data, k) for k in DATA_OPTIONS if k not in ("train", "eval", "holdout")}
        return make_task(
            "dataset",
            **{
                **options,
                "train": files,
                "eval": (),
                "holdout": 0,
                "shuffle": False,
                "sft_key": None,
                "seed": cfg.seed,
            },
        )
    if isinstance(spec, dict) and isinstance(spec.get("task"), str):
        options = {k: v for k, v in spec.items() if k != "task"}
        return make_task(spec["task"], **options)
    raise ConfigError(f"eval.sets.{name} must be a file, a list of files, or {{task: NAME, ...options}}; got {spec!r}")


def build_eval_sets(cfg, task=None) -> list[EvalSet]:
    """The named sets of ``cfg.eval.sets`` (ConfigError for one that cannot be read), then
    ``task``'s own held-out set as ``eval`` (see the module docstring)."""
    sets = _named_sets(cfg)
    own = _own_set(cfg, task, sets) if task is not None else None
    return sets + ([own] if own is not None else [])


def _same_files(spec, files) -> bool:
    named = [spec] if isinstance(spec, str) else spec
    return isinstance(named, list) and bool(files) and [str(f) for f in named] == [str(f) for f in files]


def _own_set(cfg, task, named: list[EvalSet]) -> EvalSet | None:
    """The task's held-out items as the set ``eval``; None when it has none or a named set is it."""
    if any(s.name == OWN_SET for s in named):
        return None
    data_eval = list(getattr(cfg.data, "eval", None) or ())
    if any(_same_files(spec, data_eval) for spec in dict(cfg.eval.sets).values()):
        return None
    items = list(task.eval_items())
    return EvalSet(OWN_SET, items, None) if items else None


def _named_sets(cfg) -> list[EvalSet]:
    from flash.data.rows import BadRow

    sets = []
    for name, spec in dict(cfg.eval.sets).items():
        if not str(name).replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"eval.sets: name {name!r} must be letters, digits, '_' or '-'")
        try:
            task = _set_task(cfg, name, spec)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"eval.sets.{name}: {exc}") from None
        if hasattr(task, "rows_per_epoch"):
            items = []
            for i in range(min(task.rows_per_epoch, MAX_SET_ITEMS)):
                try:
                    items.append(task.item(i))
                except BadRow:
                    continue
        else:
            items = task.eval_items()
        if not items:
            raise ConfigError(f"eval.sets.{name}: no usable rows")
        sets.append(EvalSet(str(name), items, None if cfg.reward.fn else task.reward))
    return sets


def set_metrics(name: str, rewards: list[list[float]], lengths: list[int]) -> dict[str, float]:
    """Metrics of one set from each prompt's ``n`` rewards (see the module docstring)."""
    n = len(rewards[0])
    solved = [sum(r >= 1.0 for r in row) for row in rewards]
    out = {
        f"eval/{name}/mean@{n}": sum(solved) / (n * len(rewards)),
        f"eval/{name}/reward_mean": sum(map(sum, rewards)) / (n * len(rewards)),
        f"eval/{name}/response_tokens": sum(lengths) / max(1, len(lengths)),
    }
    for k in ks(n):
        out[f"eval/{name}/pass@{k}"] = sum(pass_at_k(n, c, k) for c in solved) / len(solved)
    return out


def _score(reward, item, text: str) -> float:
    """A set's own reward of one response; a reward that fails scores 0 (as in training)."""
    try:
        return float(getattr(value := reward(item, text), "reward", value))
    except Exception:  # a user reward's bug must not end the run at an evaluation
        return 0.0


def headline(metrics: dict[str, float], sets: list[EvalSet], n: int) -> float | None:
    """The run's held-out accuracy: the first set's ``mean@n`` (None without a set)."""
    return metrics.get(f"eval/{sets[0].name}/mean@{n}") if sets else None


def set_figures(metrics: dict[str, float], n: int) -> str:
    """``'eval mean@4 0.175 pass@4 0.312, dev mean@4 ...'``: each set's mean@n and pass@n."""
    names = dict.fromkeys(k.split("/")[1] for k in metrics if k.startswith("eval/") and k.count("/") == 2)
    return ", ".join(
        f"{s} mean@{n} {metrics[f'eval/{s}/mean@{n}']:.3f} pass@{n} {metrics[f'eval/{s}/pass@{n}']:.3f}"
        for s in names
        if f"eval/{s}/mean@{n}" in metrics
    )


class EvalCount:
    """What an evaluation tells ``on_progress`` (``None``: nothing): the samples generated of all
    sets' ``total`` (``eval_note``), and once a set's ``of`` samples are all generated, how many of
    them are scored (``scoring_note``, its time from the end of the set's generation)."""

    def __init__(self, total: int, on_progress: Callable[[str], None] | None):
        self.total, self.on_progress = total, on_progress
        self.before = self.of = 0
        self.start = self.scoring_start = time.monotonic()

    def next_set(self, samples: int) -> None:
        self.before, self.of = self.before + self.of, samples

    def generated(self, done: int) -> None:
        if self.on_progress is None:
            return
        if done < self.of:
            self.on_progress(eval_note(self.before + done, self.total, time.monotonic() - self.start))
        else:
            self.scoring_start = time.monotonic()
            self.on_progress(scoring_note(self.before + self.of, self.total, 0, self.of, 0.0))

    def scored(self, done: int) -> None:
        if self.on_progress is not None:
            self.on_progress(
                scoring_note(self.before + self.of, self.total, done, self.of, time.monotonic() - self.scoring_start)
            )


def _rescored(reward, items: list, texts: list[str], count: EvalCount, every_s: float = 1.0) -> list[float]:
    """The set's own reward of each response, scored here in turn (its count told about once a
    second: the scoring starts over from 0)."""
    count.generated(count.of)
    out, told = [], time.monotonic()
    for item, text in zip(items, texts):
        out.append(_score(reward, item, text))
        if time.monotonic() - told >= every_s:
            count.scored(len(out))
            told = time.monotonic()
    return out


def evaluate_sets(
    scheduler,
    sets: list[EvalSet],
    params,
    n: int,
    seed: int,
    run_dir: Path,
    step: int,
    decode: Callable[[list[int]], str],
    *,
    decode_prompt: Callable[[list[int]], str],
    on_progress: Callable[[str], None] | None = None,
) -> dict[str, float]:
    """Sample every set's prompts ``n`` times, score, write the generations; the metrics.

    ``decode`` reads a response (cut at its end of sequence), ``decode_prompt`` a whole prompt (a
    chat's system turn ends in the end-of-sequence token too; the problem after it is kept).
    ``on_progress`` gets ``EvalCount``'s lines as samples are generated (all sets counted together)
    and as a set's samples are scored."""
    metrics: dict[str, float] = {}
    count = EvalCount(sum(len(s.items) for s in sets) * n, on_progress)
    for s in sets:
        items = [item for item in s.items for _ in range(n)]
        count.next_set(len(items))
        samples = scheduler.evaluate_samples(
            items, params, tag=s.name, seed=seed, on_progress=count.generated, on_scored=count.scored
        )
        texts = [decode(x.response_ids) for x in samples]
        rewards = _rescored(s.rescore, items, texts, count) if s.rescore else [x.reward for x in samples]
        metrics.update(
            set_metrics(
                s.name, [rewards[i : i + n] for i in range(0, len(rewards), n)], [len(x.response_ids) for x in samples]
            )
        )
        out = run_subdir(run_dir, "eval", s.name)
        with open_run_file(out / f"step-{step}.jsonl", "w") as f:
            for i, (item, x, text, r) in enumerate(zip(items, samples, texts, rewards)):
                f.write(
                    json.dumps(
                        {
                            "item": i // n,
                            "sample": i % n,
                            "prompt": decode_prompt(list(x.prompt_ids)),
                            "response": text,
                            "answer": getattr(item, "answer", None),
                            "reward": r,
                            "finish_reason": x.finish_reason,
                            "tokens": len(x.response_ids),
                        }
                    )
                    + "\n"
                )
    return metrics
