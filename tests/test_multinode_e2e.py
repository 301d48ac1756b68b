"""flash across Ray nodes: ``ray.address`` joins a cluster of three raylets (``ray.cluster_utils``,
one machine): the driver's node and two nodes of one simulated GPU each. The trainer (device 0)
and the engine (device 1) land on different nodes, the weights cross between them every step
through the model-update group, and the synchronous run's samples and losses equal the plain
single-process loop's.
"""

import os
import subprocess
import sys

import pytest
import ray
from ray.cluster_utils import Cluster

from flash.app.runner import Run
from tests.helpers.inproc import assert_equals_plain_loop, small_cfg
from tests.helpers.processes import ROOT


@pytest.fixture
def cluster():
    ray.shutdown()
    c = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 2, "num_gpus": 0})
    for _ in range(2):
        c.add_node(num_cpus=2, num_gpus=1)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


def node_of(actor) -> str:
    """The node an actor runs on, from the GCS's actor table (the state API needs the dashboard)."""
    from ray._private import state

    return state.actors(actor._actor_id.hex())["Address"]["NodeID"]


def test_trainer_and_engine_on_two_nodes_reproduce_the_synchronous_loop(tmp_path, warm_cache, cluster):
    cfg = small_cfg(tmp_path, warm_cache, "async_ratio=0", "algo.loss.name=ppo", f"ray.address={cluster.address}",
                    "placement.num_gpus=2", "placement.roles.actor_train.device_mapping=[0]",
                    "placement.roles.actor_infer.device_mapping=[1]")
    r = Run(cfg, "two-nodes")
    try:
        nodes = {node_of(r.roles.trainer), node_of(r.roles.replicas[0])}
        assert len(nodes) == 2 and len(ray.nodes()) == 3
        assert ray.get_runtime_context().get_node_id() not in nodes  # the driver's node holds no GPU
        r.scheduler.start()
        r.scheduler.start_admission()
        records = r.controller.run(3)
        stats = ray.get(r.roles.engine.stats.remote())
    finally:
        r.close()
    assert stats["version"] == 3 and r.roles.model_update.backend == "gloo"  # across nodes: not shared memory
    assert all(rec.metrics["model_update/bytes"] > 0 for rec in records)
    assert_equals_plain_loop(records, cfg, r, 3)


def test_a_local_run_starts_its_own_ray_beside_a_running_cluster(cluster):
    """A cluster registered on this machine (as `ray start` or ray.cluster_utils leaves it) is not
    joined by a run without ``ray.address``: plain ``ray.init()`` would join it."""
    code = ("from flash.cluster import init_ray; import ray; init_ray(None, 1); "
            "print(len(ray.nodes()), ray.cluster_resources().get('GPU', 0))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.split() == ["1", "0"]  # its own one node, not the cluster's three (2 GPUs)
