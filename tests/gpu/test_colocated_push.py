"""A weight push between Ray actors that share one GPU goes by CUDA IPC and is exact.

The trainer actor (fp32 weights on the GPU) and two torch-engine replicas (bf16 weights on the same
GPU) take a fraction of it each, as a colocated placement gives them. ``auto`` must choose
``cuda_ipc``; after a push every replica's state dict holds, bit for bit, the trainer's weights cast
to bf16 (the cast happens once, in the trainer's pack, and the tied LM head is sent once); a
second push after the weights change reuses the mapped buffer and is exact again.
"""

from __future__ import annotations

import pytest
import ray
import torch

from flash.cluster import init_ray
from flash.engine.torch_worker import EngineWorker
from flash.train.worker import TrainerWorker
from flash.weights.group import ModelUpdateGroup
from flash.weights.model_update import as_bytes, unique_tensors
from tests.helpers.models import TINY, save_tiny
from tests.helpers.train import settings
from tests.helpers.weights import push

TRAINER_GPU, ENGINE_GPU = 0.5, 0.25  # one GPU: the trainer and two replicas


class GpuTrainer(TrainerWorker):
    """The trainer actor with its model on the GPU (a no-op where the trainer places it itself)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.trainer.model.to("cuda")

    def scramble(self, seed: int) -> None:
        """New weights (std 0.2), so that a push visibly changes the replicas."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.trainer.model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)

    def weights_cpu(self) -> dict:
        return {k: v.detach().cpu().clone() for k, v in self.trainer.model.state_dict().items()}


@pytest.fixture(scope="module")
def actors(tmp_path_factory):
    ray.shutdown()  # a Ray left by an earlier module may have been started without the GPU
    init_ray(None, num_cpus=4, num_gpus=1)
    path = save_tiny(tmp_path_factory.mktemp("tiny"), TINY)
    trainer = ray.remote(GpuTrainer).options(num_cpus=0, num_gpus=TRAINER_GPU).remote(path, settings(), 0, 1, [], [])
    # the torch engine on the GPU Ray gives it (flash.devices.actor_device), serving bf16
    engine = ray.remote(EngineWorker).options(num_cpus=0, num_gpus=ENGINE_GPU, max_concurrency=8)
    engines = [engine.remote(path, 8, 0, 1, "bfloat16") for _ in range(2)]
    ray.get([trainer.stats.remote()] + [e.stats.remote() for e in engines])
    yield trainer, engines
    ray.shutdown()


def assert_bf16_copies(trainer, engines):
    want = ray.get(trainer.weights_cpu.remote())
    for r, got in enumerate(ray.get([e.get_weights.remote() for e in engines])):
        assert got.keys() == want.keys()
        for name, t in got.items():
            assert t.dtype == torch.bfloat16, f"replica {r}: {name} is {t.dtype}"
            assert torch.equal(as_bytes(t.contiguous()), as_bytes(want[name].to(torch.bfloat16))), (
                f"replica {r}: {name} differs from the trainer's weights cast to bf16"
            )


def test_cuda_ipc_push_is_the_trainers_weights_cast_to_bf16_bitwise(actors):
    trainer, engines = actors
    group = ModelUpdateGroup(trainer, engines, backend="auto", bucket_mb=0.05, timeout_s=120)
    assert group.setup() == "cuda_ipc"
    try:
        ray.get(trainer.scramble.remote(1))
        stats = push(group, engines, 1)
        assert_bf16_copies(trainer, engines)
        assert ray.get([e.version.remote() for e in engines]) == [1, 1] and group.version == 1
        full = ray.get(trainer.weights_cpu.remote())
        bf16_bytes = sum(t.numel() * 2 for _, t in unique_tensors(full))  # the tied head once, in bf16
        assert bf16_bytes <= stats["model_update/bytes"] < bf16_bytes + 64 * len(full)
        assert stats["model_update/buckets"] >= 2
        ray.get(trainer.scramble.remote(2))  # the second push reuses the buffer and its mappings
        push(group, engines, 2)
        assert_bf16_copies(trainer, engines)
        assert ray.get([e.version.remote() for e in engines]) == [2, 2]
    finally:
        group.close()
