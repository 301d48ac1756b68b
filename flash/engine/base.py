"""The rollout-engine contract every engine implements (torch now, vLLM next).

A request is one prompt to complete; sampling is seeded per request so that the tokens a request
gets do not depend on which other requests share its batch. Every response token carries the
logprob the engine sampled it with (the behaviour policy, at the request's temperature) and the
policy ``version`` of the weights that produced it.

Interrupt modes at ``pause`` (DESIGN.md invariant 4):
- ``continue``: in-flight requests keep their partial responses; after ``update_weights`` and
  ``resume`` they are re-prefilled under the new weights and go on (later tokens carry the new
  version).
- ``restart``: in-flight requests drop their partial responses and go back to the waiting queue;
  they regenerate from scratch (same per-request seed) after ``resume``.
- ``wait``: no new request is started; ``pause`` returns once the running ones have finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field

INTERRUPT_MODES = ("continue", "restart", "wait")


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class GenerationOutput:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
