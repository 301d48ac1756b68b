"""One token trace (``flash.buffers.trace.TokenTrace``) behind both multi-turn paths: an environment
episode (``flash.envs.episode``) and an agent's chat session through the gateway
(``flash.envs.chat_session`` -> ``flash.controllers.agent_runtime.session_sample``)."""

from __future__ import annotations

import pytest

from flash.buffers.trace import TokenTrace
from flash.envs.chat_session import ChatSession, Turn, record
from flash.envs.episode import Transcript, add_observation, add_turn, to_sample

SAMPLE_FIELDS = (
    "prompt_id",
    "sample_index",
    "prompt_ids",
    "response_ids",
    "behav_logprobs",
    "versions",
    "reward",
    "finish_reason",
    "admitted_version",
    "loss_mask",
    "version",
)


def same_two_calls():
    """Two LLM calls with context between them, once as an episode and once as a chat session:
    [1, 5] prompt, [6, 2] sampled at version 2, [40, 9] context, [7] sampled at version 3."""
    episode = Transcript(TokenTrace([1, 5]), observations=["a", "b"], actions=["x", "y"], reward=1.0)
    add_turn(episode, [6, 2], [-0.5, -0.1], [2, 2], version_now=2)
    add_observation(episode, [40, 9])
    add_turn(episode, [7], [-0.3], [3], version_now=3)
    session = ChatSession()
    record(session, Turn([1, 5], [1, 5], True, "chat"), [6, 2], [-0.5, -0.1], [2, 2], "x")
    record(session, Turn([1, 5, 6, 2, 40, 9], [40, 9], False, "chat"), [7], [-0.3], [3], "y")
    return episode, session


def test_an_episode_and_a_chat_session_build_the_same_trace():
    episode, session = same_two_calls()
    (segment,) = session.segments
    assert (
        episode.trace
        == segment
        == TokenTrace(
            prompt_ids=[1, 5],
            response_ids=[6, 2, 40, 9, 7],
            loss_mask=[1, 1, 0, 0, 1],
            logprobs=[-0.5, -0.1, 0.0, 0.0, -0.3],
            versions=[2, 2, 3, 3, 3],
        )
    )
    assert segment.tokens == [1, 5, 6, 2, 40, 9, 7]


def test_both_paths_make_their_sample_through_the_one_conversion(monkeypatch):
    from flash.controllers.agent_runtime import session_sample

    converted = []
    to_sample_of_trace = TokenTrace.to_sample

    def spy(trace, **kw):
        converted.append(trace)
        return to_sample_of_trace(trace, **kw)

    monkeypatch.setattr(TokenTrace, "to_sample", spy)
    episode, session = same_two_calls()
    kw = {"prompt_id": 4, "sample_index": 1, "admitted_version": 2}
    a = to_sample(episode, outcome="success", meta={"k": 1}, **kw)
    rec = {"segments": session.segments, "calls": [{"segment": 0}, {"segment": 0}]}
    b = session_sample(rec, reward=1.0, outcome="success", meta={"k": 1}, **kw)
    assert converted == [episode.trace, session.segments[0]]
    assert {f: getattr(a, f) for f in SAMPLE_FIELDS} == {f: getattr(b, f) for f in SAMPLE_FIELDS}
    assert (a.response_ids, a.loss_mask, a.versions) == ([6, 2, 40, 9, 7], [1, 1, 0, 0, 1], [2, 2, 3, 3, 3])
    assert a.meta["turns"] == 2 and b.meta["calls"] == 2 and a.meta["k"] == b.meta["k"] == 1


def test_a_sample_keeps_the_first_response_tokens_and_owns_its_lists():
    trace = TokenTrace([1], [2, 3, 4], [1, 0, 0], [-0.5, 0.0, 0.0], [0, 0, 0])
    s = trace.to_sample(
        prompt_id=0, sample_index=0, reward=0.0, finish_reason="stop", admitted_version=0, meta={}, keep=1
    )
    assert (s.response_ids, s.loss_mask, s.behav_logprobs, s.versions) == ([2], [1], [-0.5], [0])
    s.prompt_ids.append(9)
    assert trace.prompt_ids == [1]


@pytest.mark.parametrize("trained, mask", [(True, [1, 1]), (False, [0, 0])])
def test_extend_appends_aligned_lists(trained, mask):
    trace = TokenTrace([1])
    trace.extend([5, 6], [-1, -2], [3, 4], trained=trained)
    assert (trace.response_ids, trace.loss_mask, trace.logprobs, trace.versions) == ([5, 6], mask, [-1.0, -2.0], [3, 4])
    assert all(type(x) is float for x in trace.logprobs)
