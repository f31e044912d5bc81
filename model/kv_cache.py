"""The self-attention KV cache: one row per slot, each row with its own length.

    keys[layer], values[layer]: (R, K, P, D)   R = rows (slots), K = key/value heads (n_kv_heads:
                                                fewer than the query heads with grouped-query
                                                attention), P = capacity (context length)
    lengths: (R,) int64 on the CPU              positions filled in each row

A forward call works on a contiguous range of rows (`rows`, a slice; all rows by default):
its new tokens go to positions lengths[row] .. lengths[row] + T - 1 of each row, so rows of
different lengths decode together in one batch. Each row's positions and its attention mask
(keys up to the query's own position, never another row's stale keys) come from its length;
so do its rotary angles and its sliding window (model/families/decoder.py). Keys are stored
already rotated. Freeing a row sets its length to 0; the memory is reused as it is, never
reallocated.

A growing cache (`grow=True`, what the engine uses on the CPU) allocates only what the tokens in
flight need: (rows in use, longest row rounded up to `block` positions), grown in place of the
old tensors when a forward call needs more, and given back by `trim` when rows finish. Its
memory follows the work (a lone 8,192-token prompt of a 135M Llama holds 0.36 GB, not 32 rows of
it); the engine keeps it within a byte budget by admitting work only while
`bytes_for(rows, positions)` fits (app/engine/core.py). CUDA graphs capture fixed addresses, so on
a GPU the cache is allocated whole, as before.
"""

from __future__ import annotations

import inspect

from dataclasses import dataclass
from functools import partial

import torch

from .parts import KVUpdate


def move_row(tensors: list[torch.Tensor], lengths: torch.Tensor, src: int, dst: int) -> None:
    """Copy the first lengths[src] positions of row src into row dst in every (R, K, P, D)
    tensor, and move the length with them (row src is left empty)."""
    n = int(lengths[src])
    for t in tensors:
        t[dst, :, :n] = t[src, :, :n]
    lengths[dst] = n
    lengths[src] = 0


class ContextLengthError(ValueError):
    """The sequence does not fit in the model's context window."""


@dataclass
class CacheWrite:
    """What one forward call over `rows` with T new tokens needs from the cache."""

    cache: "KVCache"
    rows: slice
    start: int  # where the call's tokens go when every row has the same length (else -1)
    positions: torch.Tensor | None  # (B, T) absolute position of each new token when lengths differ
    mask: torch.Tensor | None  # (B, 1, T, S) True = may attend; None when plain causality covers it
    n_keys: int  # S = max(starts) + T
    slots: torch.Tensor | None = None  # (B*K*T,) where each new key goes in a layer's flat (R*K*P, D) view

    def layer(self, index: int) -> KVUpdate:
        return partial(self.cache.update, self, index)


def bytes_per_row(n_layers: int, n_kv_heads: int, capacity: int, d_head: int, dtype: torch.dtype) -> int:
    """Memory one cache row takes: keys and values of every layer, K heads x P positions x D."""
    return 2 * n_layers * n_kv_heads * capacity * d_head * torch.empty((), dtype=dtype).element_size()


class KVCache:
    def __init__(self, n_layers: int, n_rows: int, n_kv_heads: int, capacity: int, d_head: int, *,
                 device=None, dtype=None, grow: bool = False, block: int = 256):
        self.n_layers, self.n_kv_heads, self.d_head = n_layers, n_kv_heads, d_head
        self.dtype = dtype if dtype is not None else torch.get_default_dtype()
        self.lengths = torch.zeros(n_rows, dtype=torch.long)
        self.n_rows = n_rows
        self.capacity = capacity  # the context length: positions a row may hold
        self.device = device
        self.grow, self.block = grow, block
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._allocate(0, 0) if grow else self._allocate(n_rows, capacity)

    # --- memory --------------------------------------------------------------
    @property
    def allocated(self) -> tuple[int, int]:
        """(rows, positions) the tensors hold now: (n_rows, capacity) unless the cache grows."""
        return self._allocated

    def _in_blocks(self, positions: int) -> int:
        """`positions` rounded up to whole blocks, at most the context (what a growing cache allocates)."""
        return min(self.capacity, -(-positions // self.block) * self.block)

    def bytes_for(self, rows: int, positions: int) -> int:
        """Bytes of keys and values for `rows` rows of `positions` (rounded up to a block when growing)."""
        if self.grow:
            positions = self._in_blocks(positions)
        return rows * bytes_per_row(self.n_layers, self.n_kv_heads, positions, self.d_head, self.dtype)

    @property
    def bytes_held(self) -> int:
        return self.bytes_for(*self.allocated)

    def _allocate(self, rows: int, positions: int) -> None:
        """New (rows, K, positions, D) tensors holding what the old ones held where both reach."""
        shape = (rows, self.n_kv_heads, positions, self.d_head)
        old_k, old_v = self.keys, self.values
        new_k: list[torch.Tensor] = []
        new_v: list[torch.Tensor] = []
        for layer in range(self.n_layers):  # layer by layer, each old tensor dropped once copied
            for old, new in ((old_k, new_k), (old_v, new_v)):
                t = torch.zeros(shape, device=self.device, dtype=self.dtype)
                if old:
                    r, p = min(rows, old[layer].shape[0]), min(positions, old[layer].shape[2])
                    t[:r, :, :p] = old[layer][:r, :, :p]
                    old[layer] = t  # drops the old tensor now: at most one layer's old and new at once
                new.append(t)
        self.keys, self.values = new_k, new_v
        self._allocated = (rows, positions)

    def reserve(self, rows: int, positions: int) -> None:
        """Make room for `rows` rows of `positions` positions (a growing cache grows to it, in
        whole blocks; a whole cache always has it)."""
        if not self.grow:
            return
        have_rows, have_positions = self.allocated
        positions = self._in_blocks(positions)
        if rows > have_rows or positions > have_positions:
            self._allocate(max(rows, have_rows), max(positions, have_positions))

    def trim(self, active_rows: int) -> bool:
        """Give back what rows 0 .. active_rows - 1 no longer need (a growing cache): everything when
        none is active, else the rows past them and the positions past the longest, when that halves
        the memory or more. Whether it gave anything back."""
        if not self.grow:
            return False
        longest = int(self.lengths[:active_rows].max()) if active_rows else 0
        rows, positions = self.allocated
        want = (active_rows, self._in_blocks(longest) if active_rows else 0)
        if want != (rows, positions) and (active_rows == 0 or 2 * want[0] * want[1] <= rows * positions):
            self._allocate(*want)
            return True
        return False

    # --- one forward call ----------------------------------------------------
    def row_slice(self, rows: slice | None, batch: int) -> slice:
        rows = slice(0, batch) if rows is None else rows
        start, stop, step = rows.indices(self.n_rows)
        if step != 1 or stop - start != batch:
            raise ValueError(f"rows {rows} do not match a batch of {batch}")
        return slice(start, stop)

    def begin(self, rows: slice | None, batch: int, n_new: int) -> CacheWrite:
        """Check that n_new tokens fit in every row; positions and mask for the call."""
        rows = self.row_slice(rows, batch)
        starts = self.lengths[rows].tolist()  # (B,) as ints: few small tensor ops per step
        longest = max(starts)
        if longest + n_new > self.capacity:
            raise ContextLengthError(
                f"sequence of {longest + n_new} tokens exceeds the context length {self.capacity}"
            )
        S = longest + n_new
        self.reserve(rows.stop, S)
        if min(starts) == longest:  # every row continues from the same position: slices, causal
            return CacheWrite(self, rows, longest, None, None, S)
        # rows of different lengths: query t of row b sits at starts[b] + t, sees keys 0 .. starts[b] + t
        positions = torch.tensor(starts)[:, None] + torch.arange(n_new)[None, :]  # (B, T)
        mask = torch.arange(S)[None, None, :] <= positions[:, :, None]  # (B, T, S)
        mask = mask[:, None].to(self.device)  # (B, T, S) -> (B, 1, T, S): the same for every head
        # one flat index for every layer's keys and values: (row, head, position) -> (row * H + head) * P + position
        K, P = self.keys[0].shape[1], self.keys[0].shape[2]  # K: the key/value heads; P: positions held
        heads = (torch.arange(rows.start, rows.stop)[:, None] * K + torch.arange(K)[None, :]) * P  # (B, K)
        slots = (heads[:, :, None] + positions[:, None, :]).reshape(-1)  # (B, K, T) -> (B*K*T,)
        return CacheWrite(self, rows, -1, positions.to(self.device), mask, S, slots.to(self.device))

    def update(self, write: CacheWrite, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store (B, K, T, D) keys/values at each row's positions; return (B, K, S, D) views."""
        keys, values = self.keys[layer][write.rows], self.values[layer][write.rows]  # (B, K, P, D) views
        T = k.shape[2]
        if write.slots is None:  # every row starts at the same position: one slice
            start = write.start
            keys[:, :, start:start + T] = k
            values[:, :, start:start + T] = v
        else:  # rows at different positions: one indexed copy into the flat (R*H*P, D) view
            D = k.shape[-1]
            self.keys[layer].view(-1, D).index_copy_(0, write.slots, k.reshape(-1, D))
            self.values[layer].view(-1, D).index_copy_(0, write.slots, v.reshape(-1, D))
        return keys[:, :, :write.n_keys], values[:, :, :write.n_keys]

    def fixed_update(self, layer: int, rows: torch.Tensor, lengths: torch.Tensor) -> KVUpdate:
        """For Transformer.decode_fixed: store one new (B, K, 1, D) key/value per row at position
        lengths[b] of row b (device tensors, no host sync); return all (B, K, P, D) keys/values."""

        def update(k: torch.Tensor, v: torch.Tensor):
            B = k.shape[0]
            keys, values = self.keys[layer][:B], self.values[layer][:B]  # (B, K, P, D) views
            # advanced indices (rows, lengths) around a slice: the indexed shape is (B, K, D)
            keys[rows, :, lengths] = k[:, :, 0]
            values[rows, :, lengths] = v[:, :, 0]
            return keys, values

        return update

    def commit(self, write: CacheWrite, n_new: int | torch.Tensor) -> None:
        """Advance the rows by n_new tokens (an int, or (B,) per row when rows were right-padded)."""
        self.lengths[write.rows] += n_new

    # --- rows ----------------------------------------------------------------
    def free(self, row: int) -> None:
        """Forget a row's tokens (its memory is kept for the next request)."""
        self.lengths[row] = 0

    def move(self, src: int, dst: int) -> None:
        """Copy row src's keys, values and length into row dst (to keep active rows contiguous)."""
        move_row(self.keys + self.values, self.lengths, src, dst)

    def reset(self) -> None:
        self.lengths.zero_()


def growable(model) -> bool:
    """Whether a model's family can make a growing cache (its new_kv_cache takes `grow`)."""
    return "grow" in inspect.signature(model.new_kv_cache).parameters
