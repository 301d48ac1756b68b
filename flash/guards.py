"""Guards that turn bad numbers, bad data and contradictory settings into named outcomes.

- ``SkipGuard``: the trainer skips an optimizer step whose loss or gradient norm is not finite
  (``Trainer.train_step`` reports ``skipped``); the guard counts them (``train/skipped_nonfinite``),
  logs the first, and stops the run after ``train.max_consecutive_skips`` in a row -- a run whose
  every step is NaN should end with a message, not train nothing for hours.
- ``InputGuard``: every prompt the scheduler takes passes through ``take``; a malformed, empty or
  too long one is skipped (counted per reason, the first of each kind logged) or, with
  ``data.strict``, stops the run naming the row. The data position still advances past it, so a
  resumed run skips the same rows and never re-reads one.
- ``nesting_depth`` and ``json_depth``: how deep brackets nest in untrusted text (JSON's outside
  its strings), taken before a recursive parser (``json``, Arrow's JSON reader, math-verify) sees it.
- ``check_consistency``: settings that are each valid but contradict each other fail at
  ``flash validate`` with a message naming the fix.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import accumulate
from typing import Any

from flash.errors import ConfigError, FlashError

log = logging.getLogger("flash")


class NonFiniteError(FlashError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


class DataError(FlashError):
    """A prompt failed the input checks and ``data.strict`` is on."""


class SkipGuard:
    def __init__(self, max_consecutive: int, warn: Callable[[str], None] = log.warning):
        self.max_consecutive = max_consecutive
        self.total = 0
        self.consecutive = 0
        self._warn = warn

    def update(self, step: int, skipped: bool, loss: float, grad_norm: float) -> dict[str, float]:
        """Record one step's outcome; raises ``NonFiniteError`` at the limit. Returns metrics."""
        if not skipped:
            self.consecutive = 0
            return {"train/skipped_nonfinite": float(self.total)}
        self.total += 1
        self.consecutive += 1
        if self.total == 1:
            self._warn(
                f"flash: step {step}: non-finite loss ({loss}) or grad norm ({grad_norm}); "
                f"optimizer step skipped (counted in train/skipped_nonfinite, logged once)"
            )
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteError(
                f"{self.consecutive} optimizer steps in a row (up to step {step}) had a non-finite loss or "
                f"gradient norm, the limit train.max_consecutive_skips={self.max_consecutive}; lower "
                f"train.lr, set train.grad_clip, or check the loss and reward for NaN/inf "
                f"(resume from the last checkpoint with resume=RUN_DIR)"
            )
        return {"train/skipped_nonfinite": float(self.total)}


@dataclass
class InputGuard:
    """Checks of one prompt: ``reason(item, ids)`` is None for a good prompt, else a short name."""

    max_prompt_tokens: int
    strict: bool = False
    max_consecutive: int = 10_000  # rows skipped in a row before the data is called unusable
    counts: dict[str, int] = field(default_factory=dict)
    warn: Callable[[str], None] = log.warning
    on_reject: Callable[[int, str], None] | None = None  # (data index, why) of every skipped row

    def take(self, index: int, item_fn: Callable[[int], Any], encode: Callable[[str], list[int]]):
        """The first usable prompt at data position >= ``index``: ``(index, item, ids)``."""
        for _ in range(self.max_consecutive):
            item, ids, why = self._load(index, item_fn, encode)
            if why is None:
                return index, item, ids
            self._reject(index, why, item)
            index += 1
        raise DataError(
            f"{self.max_consecutive} rows in a row up to data index {index - 1} were skipped "
            f"({self.metrics()}): the data has no usable prompt; see the first skip of each "
            f"kind in the log, or run `flash data RECIPE` to see the rows"
        )

    def _load(self, index, item_fn, encode):
        try:
            item = item_fn(index)
        except (ValueError, KeyError, TypeError, UnicodeError) as exc:
            reason = getattr(exc, "reason", "malformed")  # a dataset row names its own (flash.data.rows)
            return None, None, f"{reason}: {type(exc).__name__}: {exc}"
        prompt = getattr(item, "prompt", None)
        if not isinstance(prompt, (str, list)):
            return item, None, f"malformed: prompt is {type(prompt).__name__}, not text or a chat"
        if not prompt or (isinstance(prompt, str) and not prompt.strip()):
            return item, None, "empty"
        try:
            ids = encode(prompt)
        except (ValueError, KeyError, TypeError, UnicodeError) as exc:  # special_token: text forging one
            return item, None, f"{getattr(exc, 'reason', 'malformed')}: cannot tokenize: {exc}"
        if self.max_prompt_tokens and len(ids) > self.max_prompt_tokens:
            return item, None, f"too_long: {len(ids)} tokens > data.max_prompt_tokens={self.max_prompt_tokens}"
        return item, ids, None

    def _reject(self, index: int, why: str, item) -> None:
        kind = why.split(":", 1)[0]
        if self.strict:
            raise DataError(
                f"prompt at data index {index} is {why}; fix or remove the row, or set "
                f"data.strict=false to skip such rows (counted in data/skipped_{kind})"
            )
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if self.on_reject is not None:
            self.on_reject(index, why)
        if self.counts[kind] == 1:
            self.warn(
                f"flash: skipping prompt at data index {index}: {why} (first of its kind; every "
                f"skip is counted in data/skipped_{kind}); example: {str(item)[:200]}"
            )

    def metrics(self) -> dict[str, float]:
        return {f"data/skipped_{k}": float(v) for k, v in sorted(self.counts.items())}


def nesting_depth(text: bytes, opens: bytes, closes: bytes) -> int:
    """The deepest nesting of the ``opens`` brackets in ``text`` (vectorized); a closer with
    nothing open is ignored, so leading closers cannot hide depth."""
    import numpy as np

    table, other = _bracket_table(opens, closes)
    level = np.cumsum(np.frombuffer(text.translate(table, other), dtype=np.uint8).astype(np.int64) - 1)
    if not len(level):
        return 0
    return int((level - np.minimum.accumulate(np.minimum(level, 0))).max())


def json_depth(text: str | bytes) -> int:
    """The deepest nesting of arrays and objects in JSON ``text`` (0 for a scalar), without parsing
    it: escaped backslashes and quotes are dropped, then every byte but quotes and brackets, then
    what lies between quotes (the strings); the depth is the highest running sum of +1 per opening
    and -1 per closing bracket. A parser stops at a closer with nothing open, so what follows one
    is never parsed: the sum is not clamped there. On malformed text the measure may be too high
    (an unclosed string's brackets count), never too low for what a JSON parser reads."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    data = data.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_JSON_STRUCTURE)
    brackets = b"".join(data.split(b'"')[::2])
    if len(brackets) < 1024:  # a few brackets: a plain running sum is quicker than numpy's set-up
        return max(0, max(accumulate(map(_JSON_STEP.__getitem__, brackets)), default=0))
    import numpy as np

    return max(0, int(np.cumsum(_json_steps()[np.frombuffer(brackets, np.uint8)]).max()))


@lru_cache(maxsize=1)
def _json_steps():
    import numpy as np

    return np.array(_JSON_STEP, np.int32)


_NOT_JSON_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"')
_JSON_STEP = [1 if b in b"[{" else -1 if b in b"]}" else 0 for b in range(256)]


@lru_cache(maxsize=8)
def _bracket_table(opens: bytes, closes: bytes) -> tuple[bytes, bytes]:
    """A ``bytes.translate`` table sending openers to 2 and closers to 0, and the bytes it deletes."""
    table = bytes.maketrans(opens + closes, b"\x02" * len(opens) + b"\x00" * len(closes))
    return table, bytes(b for b in range(256) if b not in opens + closes)


def check_consistency(cfg) -> None:
    """Raise ConfigError for settings that are valid alone but contradict each other."""
    for ok, msg in _contradictions(cfg):
        if not ok:
            raise ConfigError(msg)


def _contradictions(cfg):
    cores = cfg.ray.num_cpus or (os.cpu_count() or 2) if not cfg.ray.address else 0
    threads = cfg.resources.engine_threads + cfg.resources.trainer_threads
    both_set = cfg.resources.engine_threads and cfg.resources.trainer_threads
    ck = cfg.checkpoint
    yield (
        cfg.async_ratio == 0 or not cores or cores >= 2,
        (
            f"async_ratio={cfg.async_ratio} overlaps rollout and training, but ray.num_cpus={cores} leaves one "
            f"core, so they could only take turns; set async_ratio=0 (synchronous) or ray.num_cpus>=2"
        ),
    )
    yield (
        cfg.async_ratio == 0 or not cores or not both_set or threads <= cores,
        (
            f"resources.engine_threads + resources.trainer_threads = {threads} > {cores} cores with "
            f"async_ratio={cfg.async_ratio}: the overlapping roles would fight for cores; lower them so they "
            f"sum to <= {cores}, or leave them 0 (auto split)"
        ),
    )
    yield ck.keep_last >= 1, f"checkpoint.keep_last must be >= 1, got {ck.keep_last}"
    yield ck.every_steps >= 0, f"checkpoint.every_steps must be >= 0 (0: only at the end), got {ck.every_steps}"
    yield (
        ck.enabled or not ck.every_steps,
        f"checkpoint.every_steps={ck.every_steps} but checkpoint.enabled=false; drop one of them",
    )
    yield (ck.enabled or not cfg.resume, "resume needs checkpoints; remove checkpoint.enabled=false")
    yield (
        not (cfg.resume and cfg.run_dir) or cfg.resume == cfg.run_dir,
        (
            f"resume={cfg.resume} and run_dir={cfg.run_dir} name different run dirs; a resumed run continues "
            f"in its own dir, so drop run_dir"
        ),
    )
    yield cfg.rollout.hang_timeout_s > 0, f"rollout.hang_timeout_s must be > 0, got {cfg.rollout.hang_timeout_s}"
    yield cfg.rollout.max_engine_restarts >= 0, "rollout.max_engine_restarts must be >= 0"
    yield cfg.rollout.max_worker_restarts >= 0, "rollout.max_worker_restarts must be >= 0"
    yield cfg.train.max_consecutive_skips >= 1, "train.max_consecutive_skips must be >= 1"
    yield cfg.data.max_prompt_tokens >= 0, "data.max_prompt_tokens must be >= 0 (0: context minus max_new_tokens)"
    ctx = cfg.model.tiny.max_positions
    yield (
        cfg.model.path or cfg.model.gguf or cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens <= ctx,
        (
            f"data.max_prompt_tokens={cfg.data.max_prompt_tokens} + rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens} exceeds the tiny model's context model.tiny.max_positions={ctx}; "
            f"lower one of them or raise model.tiny.max_positions"
        ),
    )
