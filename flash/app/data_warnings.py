"""Warnings before a run wastes itself: what `flash validate` and `flash data` say about a recipe's
data that no check refuses, yet makes the run learn nothing. One line each, naming the fix:

- **long responses**: demonstrations (the warm start's, when it runs) or references longer than
  ``rollout.max_new_tokens`` in the run's tokenizer: every response like them is cut at the cap
  (``finish_reason: length``) and scores 0;
- **every row dropped**: none of the first rows survives the input guard (the reason of each of the
  first few rows is shown);
- **rows naming a reward the recipe does not allow**: a ``data.reward_key`` value that is neither a
  registered reward nor a ``data.rewards`` name (a typo: ``mth``) makes its row a skipped
  ``bad_reward_name`` row, never trained (the first such row's value and the closest name shown);
- **every reference scores 0**: a sample of references, each scored as its own response by the
  run's reward (``reward.fn``, else the task's), all get 0: a reward reading the wrong column or an
  answer format it cannot parse.

The scan is ``flash.app.data_preview.scan`` (the same guard the run uses).
"""

from __future__ import annotations

from typing import Any, Callable

SAMPLE_REFERENCES = 16  # references scored against themselves
SHOW_ROWS = 3


def token_count(tokenizer, text: str) -> int | None:
    """Tokens of ``text`` as a response (no special tokens; + 1 for the end of sequence), or None
    when the tokenizer cannot encode it."""
    from flash.chat_encoding import text_ids

    try:
        return len(text_ids(tokenizer, str(text))) + 1
    except (ValueError, KeyError, TypeError, UnicodeError):
        return None


def length_warning(what: str, lengths: list[int], cap: int) -> str | None:
    """One line when some of ``lengths`` (tokens) exceed ``cap`` (rollout.max_new_tokens)."""
    over = [n for n in lengths if n > cap]
    if not over:
        return None
    return (
        f"{len(over)} of {len(lengths)} {what} are longer than rollout.max_new_tokens={cap} (longest "
        f"{max(over)} tokens): responses like them are cut at {cap} tokens and score 0; set "
        f"rollout.max_new_tokens={max(over)} or shorten them"
    )


def dropped_warning(scanned: int, kept: int, rejects: list[tuple[int, str]]) -> str | None:
    """One line when rows were scanned and none was kept: each of the first rows' reason."""
    if scanned == 0 or kept > 0 or not rejects:
        return None
    rows = "; ".join(f"row {i}: {why[:120]}" for i, why in rejects[:SHOW_ROWS])
    return (
        f"every one of the first {scanned} rows is dropped ({rows}): the run would have no prompt; "
        f"fix the rows or the data.* keys naming their columns (flash data RECIPE shows them)"
    )


def reward_name_warning(scanned: int, rejects: list[tuple[int, str]]) -> str | None:
    """One line when some of the scanned rows name a reward the recipe does not allow
    (``bad_reward_name``): the run skips them."""
    bad = [(i, why) for i, why in rejects if why.startswith("bad_reward_name:")]
    if not bad:
        return None
    index, why = bad[0]
    return (
        f"{len(bad)} of the first {scanned} rows name a reward the recipe does not allow and would be skipped "
        f"(data/skipped_bad_reward_name), never trained; data index {index}: {why.split(': ', 2)[-1][:300]}"
    )


def reference_warning(scores: list[float | str]) -> str | None:
    """One line when every reference scored as its own response got 0 (or the reward failed)."""
    if not scores or any(not isinstance(s, str) and s != 0.0 for s in scores):
        return None
    errors = [s for s in scores if isinstance(s, str)]
    how = f"; e.g. {errors[0]}" if errors else ""
    return (
        f"the reward scores every one of {len(scores)} references 0 when the reference itself is the "
        f"response{how}: nothing can earn a reward; check data.answer_key / data.reward (or reward.fn) "
        f"against the answer format"
    )


def run_scorer(cfg, task) -> Callable[[Any, str], Any] | None:
    """The reward a run of ``cfg`` scores with: ``reward.fn`` built here (a judge excepted: it needs
    the model, None), else the task's own; None where the task runs its own episodes and scores
    them whole (a verifiers environment's rubric): no reference is a response there."""
    if getattr(task, "agent", None) is not None and not cfg.agent.fn:
        return None
    if not cfg.reward.fn:
        return task.reward
    if cfg.reward.fn.get("name") == "judge":
        return None
    from flash.rewards.registry import build_reward

    return build_reward(dict(cfg.reward.fn))


def score_reference(scorer, item) -> float | str:
    """``item``'s reference scored as a response: the reward, or ``'error: ...'``."""
    try:
        out = scorer(item, item.answer)
        return float(getattr(out, "reward", out))
    except Exception as exc:  # a reward that fails on its own reference is what this looks for
        return f"error: {type(exc).__name__}: {str(exc)[:80]}"


def demonstrations(cfg, task, items: list) -> list[str]:
    """The warm start's demonstrations of the scanned rows (none when it does not run)."""
    if cfg.model.path or cfg.model.gguf or cfg.sft.steps <= 0 or not hasattr(task, "sft_pair"):
        return []
    out = []
    for item in items:
        try:
            out.append(task.sft_pair(item.index)[1])
        except (NotImplementedError, ValueError, KeyError, TypeError):
            return []
    return out


def data_warnings(cfg, task, tokenizer, scan: dict, scorer) -> list[str]:
    """The warnings of the module docstring from a ``data_preview.scan`` of the train rows."""
    items = [item for item, _, _ in scan["kept"]]
    cap = cfg.rollout.max_new_tokens
    rejects = scan.get("rejects", [])
    lines = [dropped_warning(scan["scanned"], len(items), rejects), reward_name_warning(scan["scanned"], rejects)]
    demos = demonstrations(cfg, task, items)
    refs = [item.answer for item in items if isinstance(item.answer, str)]
    kinds = (
        [("demonstrations (the references)", demos)]
        if demos == refs
        else [("demonstrations", demos), ("references", refs)]
    )
    for what, texts in kinds:
        lengths = [n for n in (token_count(tokenizer, t) for t in texts) if n is not None]
        lines.append(length_warning(what, lengths, cap))
    if scorer is not None:
        lines.append(reference_warning([score_reference(scorer, item) for item in items[:SAMPLE_REFERENCES]]))
    return [line for line in lines if line]
