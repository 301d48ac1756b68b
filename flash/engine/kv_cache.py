"""The torch engine's KV cache: one left-padded batch of K/V buffers with spare columns.

Why not ``DynamicCache``: it re-concatenates every layer's K/V on each decode step, so a step
costs a copy of the whole cache. Here, per layer, K/V buffers ``[max_rows, kv_heads, capacity,
head_dim]`` are written in place one column per step; a window ``[r0:r1, c0:c1]`` exposes the live
rows and the columns not padding in every row, so attention spans the longest live sequence; a
leaving row is swap-removed (only the moved row is copied), and whole buffers are copied only to
grow. ``flash.engine.torch_engine`` drives it.

Sized to the run, not to the engine's limits: the buffers hold as many rows as sequences have
run at once (at most ``max_rows``), and as many columns as the live rows can still need (their
longest window plus the most tokens any of them may still generate, ``reserve``'s ``rest``), so a
batch of short prompts with few new tokens holds a small cache whatever ``max_num_seqs`` and the
model's context are. Growing copies each layer's live window out, frees its old buffers, then
allocates the new ones, so old and new buffers of a layer are never alive together; a window that
fits the buffers it has moves inside them (only the window is copied).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

SLACK = 64  # spare KV columns allocated past what the live rows need, so admissions rarely reallocate


class KVLayer(DynamicLayer):
    """A ``DynamicLayer`` over preallocated buffers ``[max_rows, kv_heads, capacity, head_dim]``.

    The model sees the window ``rows r0:r1, columns c0:c1`` as its cache; ``update`` writes the new
    columns at ``c1`` in place and returns views. Buffers are allocated on the first update, so head
    counts, head_dim, dtype and device come from the model itself (GQA and any head_dim work).
    """

    def __init__(self, rows: int, capacity: int):
        super().__init__()
        self.rows, self.capacity = rows, capacity
        self.k_buf: torch.Tensor | None = None
        self.v_buf: torch.Tensor | None = None
        self.set_window(0, 0, 0, 0)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.allocate(key_states, value_states)

    def allocate(self, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        self.dtype, self.device = like_k.dtype, like_k.device
        self.k_buf = like_k.new_zeros(self.rows, like_k.shape[1], self.capacity, like_k.shape[-1])
        self.v_buf = like_v.new_zeros(self.rows, like_v.shape[1], self.capacity, like_v.shape[-1])
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
    right as long sequences leave, and the buffers are only rebuilt (``_rebuild``) when new rows,
    a new column or a long newcomer no longer fit; ``rows`` and ``capacity`` are the buffers' size.
    Finished rows are swap-removed (the last live rows move into the holes), which copies only
    the moved rows. K/V outside a row's real tokens are finite and masked out.
    """

    def __init__(self, max_rows: int, num_layers: int, device: torch.device):
        self.layers = [KVLayer(0, 0) for _ in range(num_layers)]
        self.cache = LayerCache(self.layers)
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.pos = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.pending = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.lens: list[int] = []  # pos[:n] on the host
        self.max_rows, self.rows, self.capacity = max_rows, 0, 0
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

    def reserve(self, left: int = 0, right: int = 0, rows: int = 0, rest: int = 0) -> None:
        """Make room for ``left`` columns before ``end``, ``right`` columns after it and ``rows``
        live rows; a rebuild leaves ``rest`` columns after ``end`` (the most tokens a live row may
        still take), so the live rows never need another."""
        rows = max(rows, self.n)
        if rows > self.max_rows:
            raise RuntimeError(f"KV rows overflow: {rows} > max_rows {self.max_rows}")
        if self.end < left or self.end + right > self.capacity or rows > self.rows:
            self._rebuild(left, max(right, rest), rows)

    def _rebuild(self, left: int, right: int, rows: int) -> None:
        """The live window at ``new_end = max(width, left)`` with ``right`` columns after it: moved
        inside the buffers when they are big enough, else into buffers of ``rows`` rows (at least
        twice the old, at most ``max_rows``) and ``SLACK`` spare columns."""
        width = self.end - self.start
        new_end = max(width, left)
        src, dst = slice(self.start, self.end), slice(new_end - width, new_end)
        grow = rows > self.rows or new_end + right > self.capacity
        if grow:
            self.rows = min(self.max_rows, max(rows, 2 * self.rows))
            self.capacity = new_end + max(right, SLACK)
        mask = self.mask.new_zeros(self.rows, self.capacity)
        mask[: self.n, dst] = self.mask[: self.n, src]
        for layer in self.layers:
            layer.rows, layer.capacity = self.rows, self.capacity
            if layer.is_initialized:
                self._move(layer, src, dst, grow)
        self.mask = mask
        self.start, self.end = new_end - width, new_end
        self.set_live()

    def _move(self, layer: KVLayer, src: slice, dst: slice, grow: bool) -> None:
        """``layer``'s live window copied from columns ``src`` to ``dst``: in place, or into new
        buffers of ``rows`` x ``capacity`` allocated after the old ones are let go."""
        windows = [buf[: self.n, :, src].clone() for buf in (layer.k_buf, layer.v_buf)]
        if grow:
            old = layer.k_buf
            shape = (self.rows, old.shape[1], self.capacity, old.shape[3])
            dtype, device = old.dtype, old.device
            del old
            layer.k_buf = layer.v_buf = layer.keys = layer.values = None  # the views too
            layer.k_buf, layer.v_buf = (torch.zeros(shape, dtype=dtype, device=device) for _ in range(2))
        layer.k_buf[: self.n, :, dst], layer.v_buf[: self.n, :, dst] = windows

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
