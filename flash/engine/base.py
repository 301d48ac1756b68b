"""The rollout-engine contract every engine implements: torch, vLLM, the router, test stand-ins.

The contract is four small protocols, one per caller, so that an engine can be checked (and a new
one written) against exactly what is called on it; every engine actor class satisfies all four:

- ``Rollout`` -- the schedulers: ``submit``, ``get_finished``, ``abort``;
- ``Control`` -- the controller's weight cycle and fault recovery: ``pause``, ``resume``,
  ``update_weights``, ``version``;
- ``Ops`` -- colocation and per-step metrics: ``sleep``, ``wake_up``, ``stats``, ``busy_spans``;
- ``Lifecycle`` -- readiness and fault recovery: ``health``, ``pid``, ``shutdown``.

``UpdateTarget`` holds the hooks through which an engine *replica* receives weights over the
model-update group (``flash.weights.group.UpdateReceiver``); a router is no member of the group
(the trainer sends to its replicas directly), so it satisfies the four, not this one.

A request is one prompt to complete; sampling is seeded per request so that the tokens a request
gets do not depend on which other requests share its batch. Every response token carries the
logprob the engine sampled it with (the behaviour policy, at the request's temperature) and the
policy ``version`` of the weights that produced it.

Interrupt modes at ``pause`` (docs/design.md invariant 4):
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

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args, runtime_checkable

if TYPE_CHECKING:
    import torch

InterruptMode = Literal["continue", "restart", "wait"]  # rollout.interrupt (docs/design.md invariant 4)
INTERRUPT_MODES: tuple[str, ...] = get_args(InterruptMode)
# rollout.engine: torch (embedded), vllm (vLLM's async engine), sim (GPU time from a cost model)
EngineKind = Literal["torch", "vllm", "sim"]


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
        why = f"prompt of {n} tokens + max_new_tokens {p.max_new_tokens} exceeds the context of {max_context} tokens"
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


# ---- the contract ------------------------------------------------------------------------------
@runtime_checkable
class Rollout(Protocol):
    """What the schedulers call (through ``EngineClient``): requests in, finished outputs out."""

    def submit(self, requests: list[GenerationRequest]) -> int:
        """Queue ``requests`` (a refused one finishes at once with ``finish_reason="error"``)."""

    def get_finished(self, timeout: float) -> list[GenerationOutput]:
        """Every finished output not yet taken; waits up to ``timeout`` s for the first one."""

    def abort(self, request_ids: list[str] | None = None) -> list[GenerationOutput]:
        """Stop these requests (None: all); their partial outputs come back here, not later."""


@runtime_checkable
class Control(Protocol):
    """The controller's suspend → push → resume cycle, which a recovered engine replays too."""

    def pause(self, mode: str) -> None:
        """Stop generating under an interrupt mode (``INTERRUPT_MODES``)."""

    def resume(self) -> None: ...

    def update_weights(self, named_tensors: Any, version: int) -> float:
        """Load weights in place while paused, as ``version``; returns the bytes received."""

    def version(self) -> int: ...


@runtime_checkable
class Ops(Protocol):
    """Colocation (memory released while a trainer shares the devices) and per-step metrics."""

    def sleep(self, level: int = 1) -> dict:
        """Release memory while paused; says what was released."""

    def wake_up(self) -> dict: ...

    def stats(self) -> dict[str, float]:
        """Counters (``tokens_generated``, ``busy_s``, ``idle_s``, ``version``, ...) for metrics."""

    def busy_spans(self) -> list[list[float]]:
        """Wall-clock ``[start, end]`` spans busy since the previous call (the run's timeline)."""


@runtime_checkable
class Lifecycle(Protocol):
    """What readiness checks, fault recovery and teardown call."""

    def health(self) -> bool:
        """True, or raises: the engine can no longer serve (dead thread, dead child process)."""

    def pid(self) -> int:
        """The actor's process id (fault-injection tests and benchmarks kill it)."""

    def shutdown(self) -> None: ...


@runtime_checkable
class UpdateTarget(Protocol):
    """The model-update group's receiver hooks (``flash.weights.group.UpdateReceiver``) an engine
    replica defines: its parameter shapes, how it loads pushed tensors, and what it may share."""

    def _mu_shapes(self) -> dict:
        """``{name: shape}`` a push is checked against before any byte moves."""

    def _mu_apply(self, items: Iterable, version: int) -> None:
        """Load each ``(name, tensor)`` of ``items`` as it arrives; take ``version`` last."""

    def _mu_device(self) -> torch.device:
        """Where the weights live (the backend choice compares it with the trainer's)."""

    def _mu_ties(self) -> list:
        """Groups of names sharing one storage in the live model (loaded once)."""

    def _mu_targets(self) -> dict | None:
        """Live tensors that pushed tensors may be received into directly; None: never."""


ENGINE_PROTOCOLS = (Rollout, Control, Ops, Lifecycle)
