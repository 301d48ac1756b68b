"""``flash data``: see a recipe's prompts as the engine will, and write built-in tasks as files.

``flash data RECIPE [key=value ...]`` prints the first prompts exactly as the engine receives them
(after the chat template, decoded back from the token ids) with their token counts, a histogram of
prompt lengths, the rows the input guard would drop per reason, and the reward each row's own
reference answer gets. A reference that scores 0 is a data bug (a reward reading the wrong column,
an answer format the reward cannot parse): those are counted and shown. Then the warnings of
``flash.app.data_warnings`` (responses longer than the cap, every row dropped, every reference 0).

``flash data export TASK -o FILE`` writes a built-in generated task's items as a dataset file
(``prompt``, ``answer``, ``solution`` = its SFT demonstration, and its meta columns), so a recipe
can train the same items from a file.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

from flash.app.data_warnings import data_warnings, run_scorer, score_reference
from flash.errors import ConfigError

log = logging.getLogger("flash")

SHOW = 3


def preview_tokenizer(cfg, task=None):
    """The tokenizer a run of ``cfg`` encodes prompts with (no warm start needed): the task's
    character tokenizer for the tiny model."""
    from flash.app.data import load_tokenizer, with_chat_template

    if cfg.model.path:
        return load_tokenizer(cfg, cfg.model.path)
    if cfg.model.gguf:
        from flash.cache import default_cache_dir
        from flash.gguf import gguf_checkpoint

        return load_tokenizer(cfg, gguf_checkpoint(cfg.model.gguf, default_cache_dir(cfg.cache_dir)))
    from flash.models import build_tokenizer
    from flash.train.sft import task_tokenizer

    return with_chat_template(cfg, task_tokenizer(task) if task is not None else build_tokenizer())


def histogram(lengths: list[int], bins: int = 8) -> list[tuple[int, int, int]]:
    """(low, high, count) over ``bins`` equal-width bins from min to max (inclusive bounds)."""
    if not lengths:
        return []
    lo, hi = min(lengths), max(lengths)
    width = max(1, -(-(hi - lo + 1) // bins))
    counts = Counter((n - lo) // width for n in lengths)
    return [(lo + b * width, lo + (b + 1) * width - 1, counts.get(b, 0)) for b in range(-(-(hi - lo + 1) // width))]


def scan(task, tokenizer, max_prompt_tokens: int, rows: int, scorer=None) -> dict:
    """The first ``rows`` train positions through the input guard, one row at a time: kept items
    with token ids and each kept row's reference scored by ``scorer`` (None: not scored), drops
    per reason, and each dropped row's ``(data index, why)`` in ``rejects``."""
    from flash.guards import DataError, InputGuard
    from flash.models import encode_prompt

    rejects: list[tuple[int, str]] = []
    guard = InputGuard(
        max_prompt_tokens=max_prompt_tokens,
        max_consecutive=1,
        warn=lambda _: None,
        on_reject=lambda index, why: rejects.append((index, why)),
    )
    kept, end = [], min(rows, getattr(task, "rows_per_epoch", rows))
    for index in range(end):
        try:
            _, item, ids = guard.take(index, task.item, lambda p: encode_prompt(tokenizer, p))
        except DataError:  # this row is dropped (counted, its reason in rejects)
            continue
        kept.append((item, ids, score_reference(scorer, item) if scorer is not None else None))
    dropped = Counter(getattr(task, "read_skipped", {}))  # rows skipped before reading (flash.data.limits)
    dropped.update(guard.counts)
    return {"kept": kept, "dropped": dict(dropped), "scanned": end, "rejects": rejects}


def preview(cfg, rows: int = 1000, out=print) -> dict:
    """Print the preview of ``cfg``'s data (see the module docstring); returns the scan."""
    from flash.app.data import build_task
    from flash.models import encode_prompt

    task = build_task(cfg)
    tokenizer = preview_tokenizer(cfg, task)
    limit, scorer = cfg.data.max_prompt_tokens or 0, run_scorer(cfg, task)
    result = scan(task, tokenizer, limit, rows, scorer)
    kept = result["kept"]
    first_request = getattr(task, "first_request", None)  # an agent's first chat, as the engine sees it
    for item, ids, reward in kept[:SHOW]:
        scored = f"reference reward {reward}" if scorer is not None else "its episodes scored whole"
        if first_request is not None:
            ids = encode_prompt(tokenizer, first_request(item))
        out(f"--- data index {item.index} ({len(ids)} tokens; {scored}) ---")
        out(tokenizer.decode(ids))
    lengths = [len(ids) for _, ids, _ in kept]
    out(f"prompt tokens over {len(kept)} rows (of the first {result['scanned']} train positions):")
    for lo, hi, n in histogram(lengths):
        out(f"  {lo:>6}-{hi:<6} {n:>7}  {'#' * max(1 if n else 0, round(40 * n / max(1, len(kept))))}")
    out(f"dropped: {result['dropped'] or 'none'}")
    for index, why in result["rejects"][:SHOW]:
        out(f"  data index {index}: {why[:160]}")
    if scorer is None:
        out("references: not scored (the reward scores whole episodes, or is a judge that needs the model)")
    else:
        zero = [(item, r) for item, _, r in kept if r == 0.0 or isinstance(r, str)]
        out(f"references scoring 0 (a data or reward bug): {len(zero)} of {len(kept)}")
        for item, r in zero[:SHOW]:
            out(f"  data index {item.index}: answer {str(item.answer)[:80]!r} -> {r}")
        held_out_references(task, scorer, out)
    for line in data_warnings(cfg, task, tokenizer, result, scorer):
        out(f"warning: {line}")
    return result


def held_out_references(task, scorer, out=print) -> list:
    """Score the held-out rows' references (a dataset's ``eval_items``, up to its ``eval_size``)
    and print how many score 0; returns their scores (none for a task without held-out rows)."""
    try:
        items = task.eval_items() if len(getattr(task, "eval_ids", ())) else []
    except ValueError as exc:  # every held-out row is bad: say so, as for the train rows
        out(f"held-out references: not scored ({exc})")
        return []
    scores = [score_reference(scorer, item) for item in items]
    if items:
        zero = [(item, r) for item, r in zip(items, scores) if r == 0.0 or isinstance(r, str)]
        out(f"held-out references scoring 0: {len(zero)} of {len(items)}")
        for item, r in zero[:SHOW]:
            out(f"  held-out index {item.index}: answer {str(item.answer)[:80]!r} -> {r}")
    return scores


def recipe_warnings(cfg, task, rows: int = 200) -> list[str]:
    """`flash validate`'s data warnings (flash.app.data_warnings) over the first ``rows`` train rows;
    none for environment and agent tasks (their responses are episodes) and a GGUF model (its
    tokenizer comes with the conversion)."""
    from flash.envs.task import EnvTask

    if isinstance(task, EnvTask) or cfg.agent.fn or cfg.model.gguf or not hasattr(task, "item"):
        return []
    tokenizer = preview_tokenizer(cfg, task)
    result = scan(task, tokenizer, cfg.data.max_prompt_tokens or 0, rows)
    return data_warnings(cfg, task, tokenizer, result, run_scorer(cfg, task))


def export_task(name: str, options: dict, path: str, rows: int, split: str = "train") -> int:
    """Write ``rows`` items of built-in task ``name`` to ``path`` (by suffix: .jsonl/.json, .csv,
    .parquet, or a directory for save_to_disk); returns the rows written."""
    from flash.recipes.tasks import make_task

    from flash.data.files import FORMATS, datasets_module

    task = make_task(name, **options)
    records = []
    for i in range(rows):
        item = task.item(i, split)
        record = {"prompt": item.prompt, "answer": item.answer}
        if split == "train":
            record["solution"] = task.sft_pair(i)[1]
        records.append(record | {k: v for k, v in item.meta.items() if k not in record and k != "split" and _plain(v)})
    ds = _arrow_table(datasets_module(), records)
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json"):
        ds.to_json(path, lines=True)
    elif suffix == ".csv":
        ds.to_csv(path, index=False)
    elif suffix in (".parquet", ".pq"):
        ds.to_parquet(path)
    elif not suffix:
        ds.save_to_disk(path)
    else:
        raise ConfigError(f"-o {path}: unknown file type {suffix!r}; use one of {sorted(FORMATS)} or a directory")
    return len(records)


def _arrow_table(ds_module, records: list[dict]):
    """The records as a ``datasets.Dataset``; a column Arrow cannot give one type (a list mixing
    strings and numbers, say) is written as JSON text, named once."""
    try:
        return ds_module.Dataset.from_list(records)
    except (TypeError, ValueError):  # pyarrow's ArrowTypeError / ArrowInvalid
        pass
    mixed = [k for k in records[0] if not _one_arrow_type(ds_module, [r.get(k) for r in records])]
    if mixed:
        log.warning(
            "flash: column(s) %s mix types Arrow cannot hold in one column; written as JSON text", ", ".join(mixed)
        )
    return ds_module.Dataset.from_list([r | {k: json.dumps(r.get(k)) for k in mixed} for r in records])


def _one_arrow_type(ds_module, values: list) -> bool:
    try:
        ds_module.Dataset.from_dict({"c": values})
    except (TypeError, ValueError):
        return False
    return True


def _plain(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
