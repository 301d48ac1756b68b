"""Reward errors in a row, per reward, and the stop of a run whose reward fails on every response.

A reward error is a response whose reward raised or returned no reward (``flash.buffers.reward``), in the
scheduler's reward threads or in a reward worker (``RewardRaised``); it scores 0 and is counted
(``reward_errors`` in the run's counters and ``summary.json``, ``reward/errors`` in every step's
metrics). ``RewardErrors`` also counts each reward's errors in a row over the training responses
(an evaluation's responses neither add to a streak nor end one): a dataset row's own reward
(``item.meta['reward_fn']``, chosen by ``data.reward_key``) has its own streak, every other
response the run's reward's. The longest streak is ``reward/errors_in_a_row``. When one reaches
``limit`` (``reward.max_consecutive_errors``; 0: never) the run stops with one line naming the
reward, its last error and the setting (``RewardsFailing``): a reward that fails on every
response would otherwise train on rewards of 0 to the end. The streaks are not checkpointed (the
total is, in the counters): a resumed run's streaks start at 0.
"""

from __future__ import annotations

from flash.buffers.reward import error_text, reward_value
from flash.errors import FlashError, RewardsFailing
from flash.rewards.deadline import RewardDeadline, score_within


def _chosen(item) -> str | None:
    """The reward a dataset row chose (``item.meta['reward_fn']``), None for the run's own."""
    meta = getattr(item, "meta", None)
    chosen = meta.get("reward_fn") if isinstance(meta, dict) else None
    return chosen if isinstance(chosen, str) else None


class RewardErrors:
    """Each reward's errors in a row (module docstring); ``name``: how the run's reward is named
    (``reward 'math'``, ``the wordproblems task's reward``). Not thread-safe: the core's lock
    guards it."""

    def __init__(self, limit: int = 0, name: str = "the reward"):
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self.limit, self.name = limit, name
        self._in_a_row: dict[str | None, int] = {}

    def ok(self, item) -> None:
        """A training response its reward scored: that reward's streak ends."""
        self._in_a_row.pop(_chosen(item), None)

    def failed(self, item, error: str) -> str | None:
        """A training response whose reward failed with ``error`` (``flash.buffers.reward.error_text``);
        the line that stops the run when that reward has now failed ``limit`` times in a row."""
        key = _chosen(item)
        n = self._in_a_row[key] = self._in_a_row.get(key, 0) + 1
        if not self.limit or n < self.limit:
            return None
        name = f"reward {key!r}" if key is not None else self.name
        return (
            f"{name} failed on {self.limit} training responses in a row, the run stopped "
            f"(reward.max_consecutive_errors={self.limit}); its last error: {error}. Fix the reward "
            "(`flash data RECIPE` scores each row's reference with it), or set "
            "reward.max_consecutive_errors=0 to score such responses 0 and go on"
        )

    def metrics(self) -> dict[str, float]:
        """``reward/errors_in_a_row``: the longest streak now (0 when none is running)."""
        return {"reward/errors_in_a_row": float(max(self._in_a_row.values(), default=0))}


def score_response(core, item, token_ids: list[int], training: bool = True) -> float:
    """Reward of one response by ``core`` (the ``RolloutCore``: its source's reward and decoder,
    lock, counters, ``reward_errors`` and ``reward_deadline_s``). A reward function that raises or
    returns no reward (NaN, inf, anything ``flash.buffers.reward`` refuses; in a reward worker,
    ``RewardRaised``) scores 0 and is counted (a NaN reward makes its group's advantages, and so the
    whole step's loss, NaN: the step would be skipped with every group in it); a ``training``
    response's error also counts in its reward's streak, which stops the run at the limit
    (``RewardsFailing``). Scoring runs under the response's deadline (``reward_deadline_s``,
    flash.rewards.deadline): past it, 0 with outcome ``reward_deadline``."""
    try:
        reward, decode = core.source.reward, core.source.decode
        assert reward is not None and decode is not None  # None only where the workflow scores itself
        value = reward_value(score_within(core.reward_deadline_s, reward, item, decode(token_ids)))
    except RewardDeadline:
        with core._lock:
            core.counters["reward_deadline"] += 1
        return 0.0
    except FlashError:  # e.g. reward workers that keep dying (RewardFailed): stops the run
        raise
    except Exception as exc:  # noqa: BLE001 - a user's reward bug (or a BadReward) must not kill the run
        with core._lock:
            core.counters["reward_errors"] += 1
            stop = core.reward_errors.failed(item, error_text(exc)) if training else None
        if stop is not None:
            raise RewardsFailing(stop) from None
        return 0.0
    if training:
        with core._lock:
            core.reward_errors.ok(item)
    return value
