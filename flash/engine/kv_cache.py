"""The torch engine's KV cache: one left-padded batch of K/V buffers with spare columns.

Why not ``DynamicCache``: it re-concatenates every layer's K/V on each decode step, so a step
costs a copy of the whole cache. Here, per layer, K/V buffers ``[max_rows, kv_heads, capacity,
head_dim]`` are written in place one column per step; a window ``[r0:r1, c0:c1]`` exposes the live
rows and the columns not padding in every row, so attention spans the longest live sequence; a
leaving row is swap-removed (only the moved row is copied), and whole buffers are copied only to
grow (amortised by ``SLACK`` spare columns). ``flash.engine.torch_engine`` drives it.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

SLACK = 64  # spare KV columns allocated past the current width, so appends rarely reallocate


class KVLayer(DynamicLayer):
    """A ``DynamicLayer`` over preallocated buffers ``[max_rows, kv_heads, capacity, head_dim]``.

    The model sees the window ``rows r0:r1, columns c0:c1`` as its cache; ``update`` writes the new
    columns at ``c1`` in place and returns views. Buffers are allocated on the first update, so head
    counts, head_dim, dtype and device come from the model itself (GQA and any head_dim work).
    """

    def __init__(self, max_rows: int, capacity: int):
        super().__init__()
        self.max_rows, self.capacity = max_rows, capacity
        self.k_buf: torch.Tensor | None = None
        self.v_buf: torch.Tensor | None = None
        self.set_window(0, 0, 0, 0)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.allocate(key_states, value_states)

    def allocate(self, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        self.dtype, self.device = like_k.dtype, like_k.device
        self.k_buf = like_k.new_zeros(self.max_rows, like_k.shape[1], self.capacity, like_k.shape[-1])
        self.v_buf = like_v.new_zeros(self.max_rows, like_v.shape[1], self.capacity, like_v.shape[-1])
        self.is_initialized = True
        self.set_window(self.r0, self.r1, self.c0, self.c1)

    def set_window(self, r0: int, r1: int, c0: int, c1: int) -> None:
        self.r0, self.r1, self.c0, self.c1 = r0, r1, c0, c1
        if self.is_initialized:
            self.keys, self.values = self.k_buf[r0:r1, :, c0:c1], self.v_buf[r0:r1, :, c0:c1]

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.allocate(key_states, value_states)
        c1 = self.c1 + key_states.shape[-2]
        if c1 > self.capacity:  # KVBatch.reserve prevents this; never silently overflow
            raise RuntimeError(f"KV buffer overflow: {c1} > capacity {self.capacity}")
        self.k_buf[self.r0 : self.r1, :, self.c1 : c1] = key_states
        self.v_buf[self.r0 : self.r1, :, self.c1 : c1] = value_states
        self.set_window(self.r0, self.r1, self.c0, c1)
        return self.keys, self.values


class LayerCache(DynamicCache):
    """A ``DynamicCache`` (so models treat it as one) whose layers are our ``KVLayer``s."""

    def __init__(self, layers: list[KVLayer]):
        Cache.__init__(self, layers=layers)


class KVBatch:
    """Left-padded KV cache of the running batch; live row i belongs to running sequence i.

    Rows ``0:n`` are live. Their real tokens are right-aligned at column ``end`` (exclusive) and
    fit in the window ``start:end``; ``mask`` is 1 exactly at real tokens, ``pos[i]`` counts row
    i's real tokens (the position id of its next token) and ``lens[i]`` is the same count on the
    host, so the window never needs a device read; ``pending[i]`` is row i's next input token,
    kept on the device from one decode step to the next. Columns are absolute: ``start`` moves
    right as long sequences leave, and the buffers are only copied (``_rebuild``) when a new
    column or a long newcomer no longer fits, at most about once per ``width`` decode steps.
    Finished rows are swap-removed (the last live rows move into the holes), which copies only
    the moved rows. K/V outside a row's real tokens are finite and masked out.
    """

    def __init__(self, max_rows: int, num_layers: int, capacity: int, device: torch.device):
        self.layers = [KVLayer(max_rows, capacity) for _ in range(num_layers)]
        self.cache = LayerCache(self.layers)
        self.mask = torch.zeros(max_rows, capacity, dtype=torch.long, device=device)
        self.pos = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.pending = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.lens: list[int] = []  # pos[:n] on the host
        self.max_rows, self.capacity = max_rows, capacity
        self.n = self.start = self.end = 0

    def set_window(self, r0: int, r1: int, c0: int, c1: int) -> None:
        for layer in self.layers:
            layer.set_window(r0, r1, c0, c1)

    def set_live(self) -> None:
        """Point the cache at the live rows, trimming columns that are padding in every row."""
        self.start = self.end - max(self.lens) if self.n else self.end
        self.set_window(0, self.n, self.start, self.end)

    @property
    def padded(self) -> bool:
        """Whether some live row is shorter than the window (its mask has padding)."""
        return bool(self.lens) and min(self.lens) < max(self.lens)

    def advance(self) -> None:
        """Every live row took its pending token into the cache (one decode step)."""
        self.end += 1
        self.pos[: self.n] += 1
        self.lens = [n + 1 for n in self.lens]
        self.set_live()

    def reserve(self, left: int = 0, right: int = 0) -> None:
        """Make room for ``left`` columns before ``end`` and ``right`` columns after it."""
        if self.end < left or self.end + right > self.capacity:
            self._rebuild(left, right)

    def _rebuild(self, left: int, right: int) -> None:
        """Copy the live window into fresh buffers with slack on both sides (amortised growth)."""
        width = self.end - self.start
        new_end = max(width, left)
        cap = new_end + max(right, new_end, SLACK)
        src, dst = slice(self.start, self.end), slice(new_end - width, new_end)
        mask = self.mask.new_zeros(self.max_rows, cap)
        mask[: self.n, dst] = self.mask[: self.n, src]
        for layer in self.layers:
            layer.capacity = cap
            if layer.is_initialized:
                for name in ("k_buf", "v_buf"):
                    old = getattr(layer, name)
                    new = old.new_zeros(old.shape[0], old.shape[1], cap, old.shape[3])
                    new[: self.n, :, dst] = old[: self.n, :, src]
                    setattr(layer, name, new)
        self.mask, self.capacity = mask, cap
        self.start, self.end = new_end - width, new_end
        self.set_live()

    def remove(self, rows: list[int]) -> list[int]:
        """Drop live ``rows``; returns the old row index of each remaining row, in new row order."""
        order = list(range(self.n))
        for r in sorted(rows, reverse=True):
            last = self.n - 1
            if r != last:
                self.mask[r, : self.end] = self.mask[last, : self.end]
                self.pos[r] = self.pos[last]
                self.pending[r] = self.pending[last]
                self.lens[r] = self.lens[last]
                for layer in self.layers:
                    if layer.is_initialized:
                        layer.k_buf[r, :, self.start : self.end] = layer.k_buf[last, :, self.start : self.end]
                        layer.v_buf[r, :, self.start : self.end] = layer.v_buf[last, :, self.start : self.end]
                order[r] = order[last]
            order.pop()
            self.lens.pop()
            self.n -= 1
        self.set_live()
        return order
