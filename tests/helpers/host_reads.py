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


class HostCopies:
    """Records, by caller, every call that copies a tensor into host memory (``Tensor.cpu``,
    ``pin_memory``, ``numpy``, a ``Tensor.to`` naming the CPU) and every ``Tensor.to`` (a cast
    or a move: a copy beside its source). On CPU tensors no device check can tell the host from
    the device; code that names the host, or casts beside a buffer, is what these calls show."""

    def __init__(self, monkeypatch) -> None:
        self.host: list[str] = []
        self.to: list[str] = []
        self.on = False
        for name in ("cpu", "pin_memory", "numpy"):
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name), always=True))
        monkeypatch.setattr(torch.Tensor, "to", self._wrap("to", torch.Tensor.to, always=False))

    def _wrap(self, name: str, original, always: bool):
        def counted(tensor, *args, **kwargs):
            if self.on:
                caller = sys._getframe(1)
                where = f"{name} at {caller.f_code.co_filename}:{caller.f_lineno}"
                if always or _names_cpu(args, kwargs):
                    self.host.append(where)
                if name == "to":
                    self.to.append(where)
            return original(tensor, *args, **kwargs)

        return counted


def _names_cpu(args, kwargs) -> bool:
    """Whether a ``Tensor.to`` call's arguments name the CPU as its target."""
    for a in (*args, kwargs.get("device")):
        if (isinstance(a, str) and a.startswith("cpu")) or (isinstance(a, torch.device) and a.type == "cpu"):
            return True
    return False
