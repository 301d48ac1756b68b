"""A result depends on the config, never on the process that computed it.

Float sums are reduced in a thread-count-dependent order, so a stage that inherited its caller's
torch thread count (a warm start built inside a test session after another test changed the count)
gave different numbers than the same config run from the CLI. Each stage pins its own count
(``sft.threads``, ``resources.*_threads``), and the summary records them.
"""

import json

import pytest
import torch

from flash.app.config import load_config
from flash.app.runner import run
from flash.cluster import pinned_threads
from tests.helpers.processes import ROOT, SMALL, finish, launch, read_jsonl

# sync, and a warm start long enough to answer some held-out prompts (accuracies > 0 to compare)
SYNC = ["async_ratio=0", "checkpoint.every_steps=0", "sft.steps=200"]


def _losses(run_dir) -> list[float]:
    return [m["train/loss"] for m in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in m]


def _warm_start_meta(cache) -> dict:
    (meta,) = list(cache.glob("sft-*/flash_warm_start.json"))
    return json.loads(meta.read_text())


@pytest.mark.slow
def test_run_in_a_one_thread_process_gives_the_cli_numbers(tmp_path, ray_local):
    """Each side builds its own warm start (separate caches): the CLI process at torch's default
    thread count, this one after ``torch.set_num_threads(1)``."""
    cli_dir, cli_cache = tmp_path / "cli", tmp_path / "cli-cache"
    finish(launch(cli_dir, str(cli_cache), [*SYNC, f"run_dir={cli_dir}"]), cli_dir)
    cli = json.loads((cli_dir / "summary.json").read_text())

    here_dir, here_cache = tmp_path / "here", tmp_path / "here-cache"
    with pinned_threads(1):
        cfg = load_config(
            str(ROOT / "recipes/stutter.yaml"), [*SMALL, *SYNC, f"run_dir={here_dir}", f"cache_dir={here_cache}"]
        )
        here = run(cfg, "stutter")
        assert torch.get_num_threads() == 1  # the caller's count is given back

    assert _warm_start_meta(here_cache)["final_loss"] == _warm_start_meta(cli_cache)["final_loss"]
    assert len(_losses(here_dir)) == cfg.train.steps
    assert _losses(here_dir) == _losses(cli_dir)  # bitwise: the same floats step by step
    assert here["eval_accuracy_final"] > 0
    for key in ("eval_accuracy_initial", "eval_accuracy_final", "samples_trained"):
        assert here[key] == cli[key], key
    assert here["threads"] == cli["threads"] == {"engine": 1, "trainer": 1, "driver": 1, "warm_start": 2}
    assert here["seed"] == cli["seed"] == cfg.seed
    assert here["versions"]["torch"] == torch.__version__
    from flash.rewards import cgroups, sandbox

    assert here["sandbox_isolation"] == cli["sandbox_isolation"] == sandbox.isolation_level()
    assert here["sandbox_cgroups"] == cli["sandbox_cgroups"] == cgroups.available()
