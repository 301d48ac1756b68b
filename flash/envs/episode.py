"""An episode as one token sequence: LLM turns and observations, only the turns trained on.

Layout of the ``Sample`` an episode becomes::

    prompt_ids   = <bos> obs_0
    response_ids = act_1 obs_1 act_2 obs_2 ... act_k          (no observation after the last act)
    loss_mask    =  1..1  0..0  1..1  0..0 ...  1..1

Every LLM turn is an engine request whose context is *all* the tokens so far (a
``flash.buffers.trace.TokenTrace``), so the trainer's forward over the sequence sees exactly what the
engine saw at each turn. Action tokens carry the engine's logprobs and versions (per turn: a turn
generated after a weight update carries the new version; with ``rollout.interrupt: continue`` even
one turn can mix versions). Observation tokens carry placeholders: logprob 0.0 and the version of
the *next* LLM turn's first token (so the sample's version, the oldest token, is always a
generated token's). The terminal observation is kept in ``meta`` but not in the sequence: nothing
after it is trained.

The functions here are pure: the scheduler owns the bookkeeping, these own the layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flash.buffers import Sample
from flash.buffers.trace import TokenTrace


@dataclass
class Transcript:
    """What one episode produced so far, in order: its tokens (``trace``) and their text."""

    trace: TokenTrace
    observations: list[str] = field(default_factory=list)  # obs_0 .. obs_k (terminal included)
    actions: list[str] = field(default_factory=list)  # act_1 .. act_k as text
    unversioned: int = 0  # trailing observation tokens still waiting for the next turn's version
    reward: float = 0.0


def add_turn(t: Transcript, token_ids: list[int], logprobs: list[float], versions: list[int], version_now: int) -> None:
    """Append an LLM turn (trained on) and date the observation tokens before it with its version."""
    first = versions[0] if versions else version_now
    if t.unversioned:
        t.trace.versions[-t.unversioned :] = [first] * t.unversioned
        t.unversioned = 0
    t.trace.extend(token_ids, logprobs, versions, trained=True)


def add_observation(t: Transcript, obs_ids: list[int]) -> None:
    """Append observation tokens (context only: mask 0, logprob 0, version set by the next turn)."""
    t.trace.extend(obs_ids, [0.0] * len(obs_ids), [0] * len(obs_ids), trained=False)
    t.unversioned += len(obs_ids)


def to_sample(
    t: Transcript, *, prompt_id: int, sample_index: int, admitted_version: int, outcome: str, meta: dict
) -> Sample:
    """The finished episode as a ``Sample`` (reward = the episode's total reward).

    Observation tokens after the last LLM turn (an episode cut by a refused request) are dropped:
    no turn read them, so they are neither context nor trained on."""
    return t.trace.to_sample(
        prompt_id=prompt_id,
        sample_index=sample_index,
        reward=t.reward,
        finish_reason=outcome,
        admitted_version=admitted_version,
        keep=len(t.trace.response_ids) - t.unversioned,
        meta={
            **meta,
            "outcome": outcome,
            "turns": len(t.actions),
            "actions": list(t.actions),
            "observations": list(t.observations),
        },
    )


def transcript_text(observations: list[str], actions: list[str]) -> str:
    """obs_0 act_1 obs_1 ... as one string: the text whose characters the episode's tokens are
    (prompt + response), which is how the SFT warm start writes demonstrations."""
    out = [observations[0]]
    for i, act in enumerate(actions):
        out.append(act)
        if i + 1 < len(observations):
            out.append(observations[i + 1])
    return "".join(out)
