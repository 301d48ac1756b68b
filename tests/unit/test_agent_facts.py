"""Facts: the numbers an agent returns beside its reward become sample fields (through every
encoding of a sample), ledger fields and per-step metrics ``agent/<name>``; what is not a fact is
dropped and counted by reason."""

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from flash.buffers import codec, wire
from flash.buffers.facts import MAX_FACTS, clean_facts, facts_means
from flash.buffers.types import Group, Sample
from flash.controllers import step_metrics
from flash.controllers.workflows.agent import Agents, _Run
from flash.controllers.workflows.base import Unit
from flash.engine.base import SamplingParams


@pytest.mark.parametrize(
    "info, facts, dropped",
    [
        ({"tool_calls": 3}, {"tool_calls": 3.0}, {}),
        (
            {"solved": True, "turns": np.int64(4), "score": np.float32(0.5)},
            {"solved": 1.0, "turns": 4.0, "score": 0.5},
            {},
        ),
        ({"log": "text", "calls": [1, 2], "n": None, "d": {"a": 1}}, {}, {"non_numeric": 4}),
        (
            {"nan": math.nan, "inf": -math.inf, "huge": 10**400, "ok_value": 1e300},
            {"ok_value": 1e300},
            {"non_finite": 3},
        ),
        ({"a/b": 1, "": 2, "x" * 65: 3, "x" * 64: 4, "sp ace": 5}, {"x" * 64: 4.0}, {"bad_key": 4}),
        (
            {"ok": 1, "retries": 2, "untrained_tokens": 3, "facts_dropped_x": 4, "okay": 5},
            {"okay": 5.0},
            {"reserved": 4},
        ),
    ],
)
def test_a_fact_is_a_finite_number_under_a_metric_safe_free_key(info, facts, dropped):
    got, counts = clean_facts(info)
    assert got == facts and dict(counts) == dropped
    assert all(type(v) is float for v in got.values())


def test_at_most_max_facts_are_kept_in_order_and_the_rest_counted():
    got, counts = clean_facts({f"f{i}": i for i in range(MAX_FACTS + 5)})
    assert list(got) == [f"f{i}" for i in range(MAX_FACTS)] and counts == {"too_many": 5}


def test_each_fact_is_averaged_over_the_samples_that_report_it():
    assert facts_means([{"calls": 2.0, "solved": 1.0}, {"calls": 4.0}, {}]) == {"agent/calls": 3.0, "agent/solved": 1.0}
    samples = [Sample(0, i, [1], meta={"facts": f}) for i, f in enumerate([{"calls": 1.0}, {"calls": 0.0}, {}])]
    assert step_metrics.facts_metrics(samples) == {"agent/calls": 0.5}
    assert step_metrics.facts_metrics([Sample(0, 0, [1])]) == {}


def _sample(facts):
    return Sample(
        7,
        0,
        [1, 2],
        response_ids=[3, 4],
        behav_logprobs=[-0.5, -0.25],
        versions=[0, 0],
        reward=1.0,
        finish_reason="stop",
        meta={"facts": facts, "data_index": 3},
    )


def test_facts_round_trip_through_the_checkpoint_codec_and_the_wire():
    facts = {"tool_calls": 3.0, "ratio": 2 / 3}
    group = Group(7, [_sample(facts)], data_index=3)
    back = codec.group_from_dict(json.loads(json.dumps(codec.group_to_dict(group))))
    assert back.samples[0].facts == facts
    frame = wire.encode_group(group)
    assert wire.decode_group(wire.unpack(frame, 1 << 20)).samples[0].facts == facts
    assert Sample(0, 0, [1]).facts == {}


class _Core:
    def __init__(self):
        self.delivered = []

    def deliver(self, outs):
        self.delivered += outs


def _agents():
    gateway = SimpleNamespace(metrics=lambda: {})
    runner = SimpleNamespace(metrics=lambda: {"ok": 1})
    to_sample = lambda record, **kw: Sample(
        kw["prompt_id"], kw["sample_index"], [1], reward=kw["reward"], meta=kw["meta"]
    )
    agents = Agents(gateway, runner, to_sample)
    agents.core = _Core()
    return agents


def test_an_agent_s_returned_dict_gives_its_sample_facts_and_counts_what_is_dropped():
    agents = _agents()
    for i, info in enumerate([{"tool_calls": 2, "log": "x"}, {"tool_calls": 4, "nan": math.nan}]):
        unit = Unit(f"u{i}", 5, i, SimpleNamespace(), [], SamplingParams(), data_index=9)
        run = _Run(unit)
        agents._runs[unit.id] = run
        agents._finish(run, SimpleNamespace(reward=1.0, outcome="ok", attempts=1, info=info))
    samples = [agents._done[f"u{i}"] for i in range(2)]
    assert [s.facts for s in samples] == [{"tool_calls": 2.0}, {"tool_calls": 4.0}]
    assert samples[0].meta["log"] == "x"  # the dict stays in meta as it was
    m = agents.metrics()
    assert m["agent/facts_dropped_non_numeric"] == 1.0 and m["agent/facts_dropped_non_finite"] == 1.0
    assert m["agent/facts_dropped_too_many"] == 0.0
    assert step_metrics.facts_metrics(samples) == {"agent/tool_calls": 3.0}


def test_a_trained_sample_s_ledger_line_lists_its_facts():
    import io

    from flash.controllers.async_controller import AsyncController

    ledger = io.StringIO()
    host = SimpleNamespace(scheduler=SimpleNamespace(drain_outcomes=lambda: []), ledger=ledger)
    AsyncController._write_ledger(host, 4, [Group(7, [_sample({"tool_calls": 3.0}), _sample({})], data_index=3)])
    lines = [json.loads(x) for x in ledger.getvalue().splitlines()]
    assert lines[0]["facts"] == {"tool_calls": 3.0} and lines[0]["step"] == 4 and "facts" not in lines[1]


def test_an_environment_s_last_info_gives_its_episode_facts():
    import threading

    from flash.buffers.trace import TokenTrace
    from flash.controllers.workflows.episode import Episodes
    from flash.envs.episode import Transcript

    counters = {}
    host = SimpleNamespace(
        _lock=threading.Lock(),
        _live={},
        _done={},
        core=_Core(),
        _count=lambda k, by=1: counters.__setitem__(k, counters.get(k, 0) + by),
    )
    unit = Unit("e0", 5, 0, SimpleNamespace(meta={"seed": 3}), [], SamplingParams(), data_index=2)
    ep = SimpleNamespace(
        worker=SimpleNamespace(close=SimpleNamespace(remote=lambda key: None)),
        key="k0",
        unit=unit,
        cancelled=False,
        transcript=Transcript(TokenTrace([1, 2]), reward=1.0),
    )
    Episodes._finish(host, ep, "success", {"outcome": "success", "steps_left": np.int64(3), "map": "4x4"})
    sample = host._done["k0"]
    assert sample.facts == {"steps_left": 3.0} and sample.finish_reason == "success"
    assert counters["facts_dropped_non_numeric"] == 1 and "facts_dropped_reserved" not in counters
    Episodes._finish(host, SimpleNamespace(**{**ep.__dict__, "key": "k1"}), "env_error")  # no info: no facts
    assert host._done["k1"].facts == {}
