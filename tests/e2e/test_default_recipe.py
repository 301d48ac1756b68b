"""The README's main job learns: the default recipe raises held-out accuracy by >= 20 points
synchronously (async_ratio=0) and >= 15 asynchronously (async_ratio=2), with the staleness bound kept.

Slow (a few minutes each on 2 cores): the whole recipe, unchanged but for the run directory, the
warm-start cache and the seeds. Seed 0 runs in the default suite; seeds 1 and 2 (their own warm
starts, ``sft.seed``) are marked ``margin`` and run with ``pytest -m margin``. The bars come from
the measured spread (BENCHMARKS.md, "Default recipe over seeds"): TOPR with the cosine lr gained
26-32 points synchronously and 23-32 at r = 2 from the three warm starts; a synchronous run is
deterministic for its seeds on one machine (another CPU's kernels round its gradients differently,
so its warm start and run differ: BENCHMARKS.md, "Learning results across machines"), an asynchronous
one depends on timing too, hence on the machine's load, so its bar keeps 8 points below the least
gain measured. Wall time
is recorded in BENCHMARKS.md by `python -m bench.async_speedup`, not asserted here (a shared CI
machine makes timed asserts flaky).
"""

import json
import math

import pytest

from flash.app.config import load_config
from tests.helpers import prebuild
from tests.helpers.processes import recipe_summary

RECIPE = prebuild.DEFAULT_RECIPE


@pytest.fixture(scope="module")
def cache(warm_cache):
    return warm_cache


SEEDS = [0, pytest.param(1, marks=pytest.mark.margin), pytest.param(2, marks=pytest.mark.margin)]


def bar(ratio: float) -> float:
    """The least gain the measured spread supports (module docstring)."""
    return 0.20 if ratio == 0 else 0.15


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("ratio", [0, 2])
def test_default_recipe_learns(tmp_path, cache, ratio, seed):
    """Each run in a process of its own, as a user runs it (no state of the test session leaks in),
    from the warm start of its seed."""
    overrides = prebuild.default_recipe_overrides(ratio, seed)
    prebuild.wait(cache, prebuild.default_recipe_entry(seed).name)
    cfg = load_config(RECIPE, overrides)
    s = recipe_summary(tmp_path, cache, RECIPE, overrides)
    gain = s["eval_accuracy_final"] - s["eval_accuracy_initial"]
    assert gain >= bar(ratio), s
    assert s["steps"] == cfg.train.steps
    assert s["samples_trained"] == cfg.train.steps * cfg.train.prompts_per_step * cfg.rollout.n
    assert s["max_staleness_observed"] <= math.ceil(ratio)
    if ratio > 0:
        assert s["max_staleness_observed"] >= 1  # it did train on older samples: truly async
    for key in (
        "eval_accuracy_initial",
        "eval_accuracy_final",
        "steps",
        "wall_seconds",
        "samples_trained",
        "max_staleness_observed",
        "async_ratio",
    ):
        assert key in s
    assert (tmp_path / "summary.json").exists() and list((tmp_path / "tb").iterdir())
    samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [x["step"] for x in samples] == [t for t in range(1, cfg.train.steps + 1) for _ in range(2)]
    assert all(
        a["reward"] >= b["reward"] and a["prompt"] and isinstance(b["response"], str)
        for a, b in zip(samples[::2], samples[1::2])
    )  # the step's best, then its worst


@pytest.mark.margin  # ~5 min: the seed-0 asynchronous run with a bfloat16 engine and trainer forward
def test_default_recipe_learns_in_bfloat16(tmp_path, cache):
    """model.dtype=bfloat16 (bf16 engine weights, bf16 forward over fp32 master weights, fp32
    logprobs) at async ratio 2 keeps the asynchronous bar, and the run reports the train-inference
    mismatch KL that bf16 widens."""
    from tests.helpers.processes import read_jsonl

    s = recipe_summary(tmp_path, cache, RECIPE, ["async_ratio=2", "model.dtype=bfloat16"])
    assert s["eval_accuracy_final"] - s["eval_accuracy_initial"] >= bar(2), s
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    values = [r["rollout/mismatch_kl"] for r in rows if "rollout/mismatch_kl" in r]
    assert values, sorted(rows[-1])
    assert all(math.isfinite(v) and v >= 0 for v in values) and max(values) > 0
