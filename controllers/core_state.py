"""A ``RolloutCore``'s checkpoint state: its parts' (admission, outcomes, the prompts in flight) and
its RNG's, and their restore (``RolloutCore.state_dict`` / ``load_state_dict``).

A prompt in flight (regular or spare, generating, scoring, or a spare's parked group) is restarted
from scratch on resume: same prompt id, data index, admission version and request seeds, for the
requests of it still live in the core; its partial responses are dropped, never its prompt. The
restore takes those requests out of the lifecycle's ``admitted`` count and admits them again, so
``admitted = ended + live`` still holds after it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flash.buffers import Group

if TYPE_CHECKING:
    from .scheduler import RolloutCore


def core_state(core: RolloutCore) -> dict:
    """The core's state (under its lock): its parts' and the RNG's."""
    with core._lock:
        version, state, gauss = core._rng.getstate()
        pending = core.inflight.state_dict(
            lambda rid: core.lifecycle.state(rid) is not None, core.admission.prov.is_spare
        )
        return {
            **core.admission.state_dict(),
            **core.outcomes.state_dict(),
            "rng": [version, list(state), gauss],
            "pending": pending,
        }


def restore_core(core: RolloutCore, state: dict, buffered_groups: list[Group] | None = None) -> int:
    """Restore ``state`` before the core starts (the buffer's groups already put back:
    ``buffered_groups``, or read from an in-process buffer) and launch the prompts in flight again
    (same prompt ids, same request seeds). Returns how many prompts restarted."""
    if buffered_groups is None:
        buffered_groups = core.buffer.snapshot()[0]
    buffered = [s.meta["request_id"] for g in buffered_groups for s in g.samples]
    with core._lock:
        core.admission.load_state_dict(state)
        version, rng, gauss = state["rng"]
        core._rng.setstate((version, tuple(rng), gauss))
        restarted = sum(len(p.get("requests", ())) for p in state["pending"])
        core.outcomes.load_state_dict(state, buffered, restarted)
        wave, reqs = core.admission.new_wave(), []
        for p in state["pending"]:
            pid = p["prompt_id"]
            item = core.source.item(p["data_index"])
            ks = p.get("requests", list(range(core.inflight.requests)))
            core.inflight.open(pid, item, p["data_index"], p["version"], wave, p.get("cap"), p.get("meta", {}))
            if p.get("spare"):  # not counted: the checkpoint's count never included it
                core.admission.prov.admitted(pid, p["version"], spare=True)
            reqs += core._start_units(pid, core.source.encode(item.prompt), ks)
        core._gate.open(wave, len(reqs))
    core.workflow.launch(reqs)
    return len(state["pending"])
