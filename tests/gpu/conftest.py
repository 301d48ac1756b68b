"""GPU tests (``python -m pytest -q tests/gpu`` on a machine with one CUDA GPU; about 8 minutes
on an H100 at most, the recipe run the longest).

Every test under this directory is marked ``gpu`` (select with ``-m gpu``, leave out with
``-m 'not gpu'``) and skipped where ``torch.cuda.is_available()`` is false, so on a CPU machine
they are collected and reported as skips. The modules import nothing that needs CUDA; fixtures
that touch the GPU run only for tests that are not skipped.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    skip = (
        None
        if torch.cuda.is_available()
        else pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    )
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if skip is not None:
                item.add_marker(skip)


@pytest.fixture(scope="module")
def nccl_mesh():
    """A one-rank NCCL process group on GPU 0 and its device mesh (an FSDP2 rank in this process)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from flash.train.fsdp import free_port

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield init_device_mesh("cuda", (1,))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model (tests.helpers.models.TINY) saved once per module."""
    from tests.helpers.models import TINY, save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny"), TINY)
