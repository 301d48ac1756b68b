"""A Ray actor that reports what devices it sees; kept in its own module so that a worker process
unpickling it imports only ``os`` and ``ray`` (a test module would drag in torch and transformers)."""

import os

import ray


class Probe:
    def seen(self) -> tuple:
        return (
            [str(i) for i in ray.get_gpu_ids()],
            os.environ.get("CUDA_VISIBLE_DEVICES"),
            os.environ.get("FLASH_DEVICES"),
        )
