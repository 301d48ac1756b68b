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

A request an engine cannot serve (``check_request``) does not fail the call that submitted it nor
stop the engine: it finishes at once with ``finish_reason="error"`` and the reason in ``error``,
delivered like any other finished request, while the engine goes on serving the others.
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
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # why the request was refused (finish_reason "error")


def check_request(req: GenerationRequest, *, vocab_size: int, max_context: int) -> str | None:
    """Why an engine cannot serve ``req`` (a message naming it), or None when it can.

    Shared by every engine so that the same request is refused the same way everywhere. The
    context must hold the prompt *and* every token asked for: an engine that ran past its
    context would silently produce tokens the model was never trained to place.
    """
    p, n = req.params, len(req.prompt_ids)
    why = None
    if n == 0:
        why = "empty prompt"
    elif p.max_new_tokens <= 0:
        why = f"max_new_tokens must be >= 1, got {p.max_new_tokens}"
    elif n + p.max_new_tokens > max_context:
        why = (f"prompt of {n} tokens + max_new_tokens {p.max_new_tokens} exceeds the context of "
               f"{max_context} tokens")
    elif p.temperature < 0 or not 0.0 < p.top_p <= 1.0:
        why = f"need temperature >= 0 and 0 < top_p <= 1, got {p.temperature} and {p.top_p}"
    else:
        bad_stop = [t for t in p.stop_token_ids if not 0 <= t < vocab_size]
        bad_prompt = [t for t in req.prompt_ids if not 0 <= t < vocab_size]
        if bad_stop:
            why = f"unknown stop token id {bad_stop[0]} (the vocabulary has {vocab_size} tokens)"
        elif bad_prompt:
            why = f"prompt token id {bad_prompt[0]} is outside the vocabulary of {vocab_size} tokens"
    return None if why is None else f"request {req.request_id!r}: {why}"


def error_output(req: GenerationRequest, message: str) -> GenerationOutput:
    """The finished output of a refused request: no tokens, ``finish_reason="error"``."""
    return GenerationOutput(req.request_id, list(req.prompt_ids), [], [], [], "error", message)
