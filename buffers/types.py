"""The sample types every role exchanges.

A ``Sample`` is one response to one prompt. The ``n`` samples drawn for one admitted prompt form a
``Group`` (GRPO-style advantages are computed within a group). Every generated token carries the
policy version that produced it (docs/design.md invariant 1); a sample's version is the oldest of its
tokens, so a response continued across a weight update counts as old as its first token.

Multi-turn episodes (``flash.envs``) put the environment's observation tokens inside the response:
they are context for later turns but not the policy's output, so ``loss_mask`` is 0 on them (None:
every response token is the policy's, the single-turn case). On observation tokens
``behav_logprobs`` is a 0.0 placeholder and ``versions`` holds the version of the next LLM turn,
which is never older than the turn before, so ``version`` (the oldest token) stays the oldest
*generated* token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class Sample:
    prompt_id: int  # the admitted prompt this sample answers (unique per admission)
    sample_index: int  # position within the group, 0..n-1
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    behav_logprobs: list[float] = field(default_factory=list)  # engine logprob per response token
    versions: list[int] = field(default_factory=list)  # policy version per response token
    reward: float = 0.0
    finish_reason: str = ""  # "stop" | "length" | "abort"
    admitted_version: int = 0  # policy version when the prompt was admitted
    meta: dict[str, Any] = field(default_factory=dict)
    loss_mask: list[int] | None = None  # per response token: 1 = trained on; None = all ones

    @property
    def version(self) -> int:
        """Oldest policy version among the tokens (the admission version if no tokens)."""
        return _oldest(self.versions) if len(self.versions) else self.admitted_version

    @property
    def group_id(self) -> int:
        return self.prompt_id

    @property
    def facts(self) -> dict[str, float]:
        """The numbers its agent reported beside the reward (``meta["facts"]``, flash.buffers.facts; {}
        for none): meta carries them through every encoding of a sample."""
        return self.meta.get("facts", {})


@dataclass(frozen=True)
class TokenField:
    """One per-token field of ``Sample``: a list (or 1-D NumPy array) with one value per token.

    ``kind``: ``"int"`` (token ids, versions), ``"float"`` (logprobs) or ``"bit"`` (0/1 integers);
    ``along``: whose tokens it has one value for, the prompt's or the response's; ``optional``: None
    is a value (``loss_mask``: every response token trained on); ``runs``: its value changes only a
    few times along a response (a weight update, a turn), so the wire may send it as runs."""

    name: str
    kind: Literal["int", "float", "bit"]
    along: Literal["prompt", "response"] = "response"
    optional: bool = False
    runs: bool = False

    @property
    def python(self) -> type:
        """The Python type of one value."""
        return float if self.kind == "float" else int


# Every per-token field of a Sample, in the order every encoding lists them (flash.buffers.wire,
# flash.buffers.codec); ``response_ids`` comes before the fields whose length it fixes.
TOKEN_FIELDS = (
    TokenField("prompt_ids", "int", along="prompt"),
    TokenField("response_ids", "int"),
    TokenField("behav_logprobs", "float"),
    TokenField("versions", "int", runs=True),
    TokenField("loss_mask", "bit", optional=True, runs=True),
)


@dataclass
class Group:
    """All ``n`` samples of one admitted prompt, complete and scored."""

    prompt_id: int
    samples: list[Sample]
    admitted_version: int = 0
    data_index: int = 0  # position of the prompt in the task's prompt stream

    @property
    def version(self) -> int:
        return min(s.version for s in self.samples)

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]


def _oldest(versions: Any) -> int:
    """``min`` of a list, or of a NumPy array without a Python-level loop (the buffer service hands
    back per-token arrays as NumPy arrays when they were put as such)."""
    return int(versions.min()) if hasattr(versions, "min") else min(versions)
