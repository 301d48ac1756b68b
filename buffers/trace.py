"""A token trace: the token sequence one multi-turn sample trains on, built call by call.

Every LLM call of an episode (``flash.envs.episode``) or of an agent's chat session
(``flash.envs.chat_session``) sees as its prompt every token of the trace so far, so the trainer's
forward over the finished trace sees exactly what the engine saw at each call (docs/design.md,
invariant 8: token exactness). Layout::

    prompt_ids   = the first prompt
    response_ids = sampled_1 context_1 sampled_2 context_2 ... sampled_k
    loss_mask    =   1..1      0..0      1..1      0..0    ...   1..1

Sampled tokens carry the engine's logprobs and versions; context tokens (observations, template
text between turns) carry logprob 0.0 and the version of the sampled token that follows them, so a
sample's version (its oldest token) is always a generated token's. ``to_sample`` is the one way a
trace becomes the ``Sample`` the trainer reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .types import Sample


@dataclass
class TokenTrace:
    """One trainable token sequence: ``prompt_ids`` then context and sampled tokens in order (the
    four per-token lists are aligned with ``response_ids``)."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        """Every token so far: the next call's prompt starts with exactly these."""
        return self.prompt_ids + self.response_ids

    def extend(self, token_ids: list[int], logprobs: list[float], versions: list[int], trained: bool) -> None:
        """Append tokens with their logprobs and versions: sampled ones (``trained``: mask 1) or
        context (mask 0)."""
        self.response_ids += list(token_ids)
        self.loss_mask += [int(trained)] * len(token_ids)
        self.logprobs += [float(x) for x in logprobs]
        self.versions += list(versions)

    def to_sample(
        self,
        *,
        prompt_id: int,
        sample_index: int,
        reward: float,
        finish_reason: str,
        admitted_version: int,
        meta: dict[str, Any],
        keep: int | None = None,
    ) -> Sample:
        """The trace as a ``Sample``: its first ``keep`` response tokens (all of them by default)."""
        end = len(self.response_ids) if keep is None else keep
        return Sample(
            prompt_id=prompt_id,
            sample_index=sample_index,
            prompt_ids=list(self.prompt_ids),
            response_ids=self.response_ids[:end],
            behav_logprobs=self.logprobs[:end],
            versions=self.versions[:end],
            reward=reward,
            finish_reason=finish_reason,
            admitted_version=admitted_version,
            loss_mask=self.loss_mask[:end],
            meta=dict(meta),
        )
