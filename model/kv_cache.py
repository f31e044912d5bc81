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

The engine's cache on the CPU holds only what the tokens in flight need, in blocks from one pool
(model/paged_kv_cache.py, the same contract; a call's CacheWrite and its rows' positions and mask
are defined there, beside the cache every CPU step uses). CUDA graphs capture fixed addresses, so
on a GPU the cache is this one, allocated whole.
"""

from __future__ import annotations

import inspect
from typing import Protocol, runtime_checkable

import torch

from attnlens.model.paged_kv_cache import CacheWrite, keys_seen, new_positions, rows_mask, rows_of
from attnlens.model.parts import KVUpdate


def move_row(tensors: list[torch.Tensor], lengths: torch.Tensor, src: int, dst: int) -> None:
    """Copy the first lengths[src] positions of row src into row dst in every (R, K, P, D)
    tensor, and move the length with them (row src is left empty)."""
    n = int(lengths[src])
    for t in tensors:
        t[dst, :, :n] = t[src, :, :n]
    lengths[dst] = n
    lengths[src] = 0


def bytes_per_row(n_layers: int, n_kv_heads: int, capacity: int, d_head: int, dtype: torch.dtype) -> int:
    """Memory one cache row takes: keys and values of every layer, K heads x P positions x D."""
    return 2 * n_layers * n_kv_heads * capacity * d_head * torch.empty((), dtype=dtype).element_size()


class KVCache:
    def __init__(self, n_layers: int, n_rows: int, n_kv_heads: int, capacity: int, d_head: int, *,
                 device=None, dtype=None):
        self.n_layers, self.n_kv_heads, self.d_head = n_layers, n_kv_heads, d_head
        self.dtype = dtype if dtype is not None else torch.get_default_dtype()
        self.lengths = torch.zeros(n_rows, dtype=torch.long)
        self.n_rows = n_rows
        self.capacity = capacity  # the context length: positions a row may hold
        self.device = device
        shape = (n_rows, n_kv_heads, capacity, d_head)
        self.keys = [torch.zeros(shape, device=device, dtype=self.dtype) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=self.dtype) for _ in range(n_layers)]

    # --- one forward call ----------------------------------------------------
    def row_slice(self, rows: slice | None, batch: int) -> slice:
        return rows_of(rows, batch, self.n_rows)

    def begin(self, rows: slice | None, batch: int, n_new: int) -> CacheWrite:
        """Check that n_new tokens fit in every row; positions and mask for the call."""
        rows = self.row_slice(rows, batch)
        starts = self.lengths[rows].tolist()  # (B,) as ints: few small tensor ops per step
        S = keys_seen(starts, n_new, self.capacity)
        if min(starts) == max(starts):  # every row continues from the same position: slices, causal
            return CacheWrite(self, rows, starts[0], None, None, S)
        positions = new_positions(starts, n_new)
        mask = rows_mask(positions, S).to(self.device)
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


@runtime_checkable
class RowCache(Protocol):
    """What the engine asks of every KV cache (this module's, the paged one, the translator's): rows,
    each with its own length, that a forward call fills and the engine frees and moves."""

    @property
    def capacity(self) -> int: ...

    @property
    def lengths(self) -> torch.Tensor: ...

    @property
    def keys(self) -> list[torch.Tensor]: ...

    @property
    def values(self) -> list[torch.Tensor]: ...

    def row_slice(self, rows: slice | None, batch: int) -> slice: ...

    def free(self, row: int) -> None: ...

    def move(self, src: int, dst: int) -> None: ...

    def reset(self) -> None: ...


@runtime_checkable
class BlockCache(RowCache, Protocol):
    """A cache in blocks from one budget (model/paged_kv_cache.py): the engine admits prompts while
    their blocks fit, and trims the pool when rows end."""

    @property
    def bytes_held(self) -> int: ...

    def bytes_for_lengths(self, lengths: list[int]) -> int: ...

    def trim(self, active_rows: int) -> bool: ...


def pageable(model) -> bool:
    """Whether a model's family can make a cache in blocks (its new_kv_cache takes `paged`)."""
    return "paged" in inspect.signature(model.new_kv_cache).parameters


def cache_paged(model, budget: int | None, device: torch.device) -> bool:
    """Whether a serving engine's KV cache for this model, on `device`, is in blocks from one pool: a
    byte budget, the CPU, and a family whose cache can be (model/paged_kv_cache.py)."""
    return budget is not None and device.type == "cpu" and pageable(model)
