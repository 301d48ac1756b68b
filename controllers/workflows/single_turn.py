"""Single-turn workflow: one engine request per unit, scored by the task's (or the pool's) reward.

A finished response is a finished unit (``route`` passes it through); the core hands it to the
reward threads as soon as it arrives (queue scheduling) and ``finish`` scores it there.
"""

from __future__ import annotations

from flash.buffers import Sample
from .base import Core, Unit
from flash.engine.base import GenerationOutput, GenerationRequest


class SingleTurn:
    """``core``: the ``RolloutCore`` that runs this workflow (its engine client and reward)."""

    core: Core | None = None

    def launch(self, units: list[Unit]) -> None:
        if units:
            assert self.core is not None  # bound by the RolloutCore before any call
            self.core.supervisor.submit([GenerationRequest(u.id, u.prompt_ids, u.params) for u in units])

    def cancel(self, ids: list[str]) -> None:
        assert self.core is not None
        self.core.supervisor.call("abort", ids)  # a dead engine is restarted; aborted ids are not requeued

    def route(self, outputs: list[GenerationOutput]) -> list[GenerationOutput]:
        return outputs

    def finish(self, unit: Unit, output: GenerationOutput) -> Sample:
        sample = Sample(
            prompt_id=unit.prompt_id,
            sample_index=unit.index,
            prompt_ids=list(output.prompt_ids),
            response_ids=list(output.token_ids),
            behav_logprobs=list(output.logprobs),
            versions=list(output.versions),
            finish_reason=output.finish_reason,
            admitted_version=unit.version,
            meta={**unit.meta, "data_index": unit.data_index, "request_id": unit.id, "request": unit.index},
        )
        assert self.core is not None
        sample.reward = self.core.score(unit.item, output.token_ids, training=unit.prompt_id >= 0)  # -1: evaluation
        return sample

    def requeue(self, lost: list[Unit], ids: list[str] | None) -> int:
        """The engine lost these requests: submit them again (same ids, same seeds)."""
        self.launch(lost)
        return len(lost)

    # ---- Service ---------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        return {}

    def stop(self) -> None:
        pass
