"""flash across Ray nodes: ``ray.address`` joins a cluster of four raylets (``ray.cluster_utils``,
one machine): the driver's node and three nodes of one simulated GPU each.

- The trainer (device 0) and the engine (device 1) land on different nodes, the weights cross
  between them every step through the model-update group, and the synchronous run's samples and
  losses equal the plain single-process loop's.
- The engine's node is removed mid-run (its raylet and every process on it killed): Ray moves the
  placement bundle to the spare node, the engine restarts there, its requests are asked again, and
  the run ends with every prompt trained exactly once; resumed on the cluster from its last
  checkpoint, it trains on with the ledger complete.
"""

import os
import subprocess
import sys
import threading
import time

import pytest
import ray
from ray.cluster_utils import Cluster

from flash.app.runner import Run, run
from tests.helpers.inproc import assert_equals_plain_loop, run_steps, small_cfg
from tests.helpers.processes import B, N, ROOT, read_jsonl, steps_done, trained_pairs


@pytest.fixture
def cluster():
    ray.shutdown()
    c = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 2, "num_gpus": 0})
    c.gpu_nodes = [c.add_node(num_cpus=2, num_gpus=1) for _ in range(3)]
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


def node_of(actor) -> str:
    """The node an actor runs on, from the GCS's actor table (the state API needs the dashboard)."""
    from ray._private import state

    return state.actors(actor._actor_id.hex())["Address"]["NodeID"]


def test_trainer_and_engine_on_two_nodes_reproduce_the_synchronous_loop(tmp_path, warm_cache, cluster):
    cfg = small_cfg(
        tmp_path,
        warm_cache,
        "async_ratio=0",
        "algo.loss.name=ppo",
        f"ray.address={cluster.address}",
        "placement.num_gpus=2",
        "placement.roles.actor_train.device_mapping=[0]",
        "placement.roles.actor_infer.device_mapping=[1]",
    )
    r = Run(cfg, "two-nodes")
    nodes, driver = {node_of(r.roles.trainer), node_of(r.roles.replicas[0])}, ray.get_runtime_context().get_node_id()
    records, stats = run_steps(r, 3)
    assert len(nodes) == 2 and len(ray.nodes()) == 4 and driver not in nodes  # the driver's node holds no GPU
    assert stats["version"] == 3 and r.roles.model_update.backend == "gloo"  # across nodes: not shared memory
    assert all(rec.metrics["model_update/bytes"] > 0 for rec in records)
    assert_equals_plain_loop(records, cfg, r, 3)


def test_a_local_run_starts_its_own_ray_beside_a_running_cluster(cluster):
    """A cluster registered on this machine (as `ray start` or ray.cluster_utils leaves it) is not
    joined by a run without ``ray.address``: plain ``ray.init()`` would join it."""
    code = (
        "from flash.cluster import init_ray; import ray; init_ray(None, 1); "
        "print(len(ray.nodes()), ray.cluster_resources().get('GPU', 0))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.stdout.split() == ["1", "0"]  # its own one node, not the cluster's four (3 GPUs)


def test_an_engine_node_lost_mid_run_recovers_and_the_run_resumes_on_the_cluster(tmp_path, warm_cache, cluster):
    layout = [
        f"ray.address={cluster.address}",
        "placement.num_gpus=2",
        "placement.roles.actor_train.device_mapping=[0]",
        "placement.roles.actor_infer.device_mapping=[1]",
        "async_ratio=2",
        "buffer.transport=zmq",
    ]
    cfg = small_cfg(tmp_path, warm_cache, *layout, "train.steps=6")
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(summary=run(cfg, "nodes")))
    worker.start()
    deadline = time.monotonic() + 600
    while steps_done(tmp_path) < 2 and worker.is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    (engine_node,) = engine_nodes()
    cluster.remove_node(next(n for n in cluster.gpu_nodes if n.node_id == engine_node))
    worker.join(600)
    faults = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "engine_fault"]
    # one fault, recovered; what it requeued is what was generating at that moment: usually some,
    # none when the removal fell between two rounds of generation (the ledger below checks either way)
    assert result["summary"]["steps"] == 6 and len(faults) == 1 and faults[0]["kind"] == "died"
    assert engine_nodes() == set()  # the run closed its roles
    pairs = trained_pairs(read_jsonl(tmp_path / "ledger.jsonl"))
    assert set(pairs.values()) == {1} and len(pairs) == 6 * B * N
    more = small_cfg(tmp_path, warm_cache, *layout, "train.steps=8", f"resume={tmp_path}")
    summary = run(more, "nodes")
    assert summary["resumed_from_step"] == 6 and summary["steps"] == 8
    pairs = trained_pairs(read_jsonl(tmp_path / "ledger.jsonl"))
    assert set(pairs.values()) == {1} and len(pairs) == 8 * B * N
    assert [m["step"] for m in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(1, 9))


def engine_nodes() -> set[str]:
    """The nodes of the live engine actors (from the GCS's actor table)."""
    from ray._private import state

    return {
        a["Address"]["NodeID"]
        for a in state.actors().values()
        if a["State"] == "ALIVE" and a["ActorClassName"] == "EngineWorker"
    }


@pytest.mark.margin  # the whole default recipe on the cluster (~3 min on 2 cores): pytest -m margin
def test_the_default_recipe_learns_across_nodes(tmp_path, warm_cache, cluster):
    """The default recipe unchanged but for its placement over two nodes and the authenticated zmq
    buffer: the single-node learning bar at its async ratio (tests/e2e/test_default_recipe.py)."""
    from flash.app.config import load_config

    overrides = [
        f"ray.address={cluster.address}",
        "placement.num_gpus=2",
        "buffer.transport=zmq",
        "placement.roles.actor_train.device_mapping=[0]",
        "placement.roles.actor_infer.device_mapping=[1]",
        f"cache_dir={warm_cache}",
        f"run_dir={tmp_path}",
        "tracking.progress=false",
    ]
    cfg = load_config("recipes/stutter.yaml", overrides)
    s = run(cfg, "stutter")
    assert s["eval_accuracy_final"] - s["eval_accuracy_initial"] >= 0.15, s
    assert s["steps"] == cfg.train.steps and s["max_staleness_observed"] <= 2
    pairs = trained_pairs(read_jsonl(tmp_path / "ledger.jsonl"))
    assert set(pairs.values()) == {1} and len(pairs) == cfg.train.steps * cfg.train.prompts_per_step * cfg.rollout.n
