"""A counter of host reads of tensors (``READS``: each a device sync on a GPU) from every caller."""

from __future__ import annotations

import sys

import torch

READS = ("item", "__float__", "__int__", "__bool__", "tolist", "cpu")


class Counter:
    """Counts the wrapped reads of every caller, by (file:line), but those of ``optimizer``'s
    host-resident step counters."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.on = False
        self.optimizer = None

    def host_resident(self, tensor) -> bool:
        states = self.optimizer.state.values() if self.optimizer is not None else ()
        return any(tensor is state.get("step") for state in states)

    def wrap(self, name: str):
        original = getattr(torch.Tensor, name)

        def counted(tensor, *args, **kwargs):
            if self.on and not self.host_resident(tensor):
                caller = sys._getframe(1)
                self.calls.append(f"{name} at {caller.f_code.co_filename}:{caller.f_lineno}")
            return original(tensor, *args, **kwargs)

        return counted
