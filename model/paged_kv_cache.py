"""The KV cache in blocks from one pool (vLLM's block table): memory follows the tokens in flight.

    keys[layer], values[layer]: (N, K, P, D)   N = blocks in the pool, K = key/value heads,
                                               P = positions a block holds (`block`), D = d_head
    tables[row]: list of block ids              row r's position p sits in block tables[r][p // P],
                                                at offset p % P
    lengths: (R,) int64 on the CPU              positions filled in each row

A row takes a block when its tokens reach it (the block after its last one when that is free, so
a row is usually one run of blocks) and gives its blocks back when it is freed; moving a row (the
engine keeps its active rows 0 .. n-1) moves its table, not its keys. The memory held is the
blocks in use: the sum of the rows' lengths, each rounded up to a block, never rows x the longest.

The pool is one allocation of N blocks (`pool_bytes`: the engine's byte budget, and at least one
whole context) that the operating system backs only where blocks have been written. `release`
hands the pages of blocks no row holds back to it (madvise), after moving the rows that remain
into one packed run when they are scattered (`compact`): a process's memory follows the tokens in
flight, up and down.

A forward call over the rows `rows` (the same contract as model/kv_cache.py's KVCache):
  - its new keys and values go to their slots in one indexed copy per tensor;
  - a decode step (one new token a row) attends over the blocks where they lie (`BlockAttention`):
    each block against its row's queries in one batched product, a softmax per row from the blocks'
    maxima and sums, each block's weighted values added into its row. No key or value is copied;
  - a prompt from position 0 attends over its own new keys and values;
  - any other call (the next piece of a long prompt; a forward whose hooks read the keys) gets its
    rows' keys and values gathered into (B, K, S, D) tensors.

What every forward call reads, whichever the cache, is here too, beside the cache each CPU step
uses: CacheWrite (the call's rows, positions, mask and slots) and the helpers that make it
(rows_of, keys_seen, new_positions, rows_mask); and the kernel's page advice (advise_within,
madvise(2) through libc) that `release` and the weight arena (model/weight_arena.py) ask for.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import heapq
import mmap
from dataclasses import dataclass
from typing import Any

import torch

from attnlens.model.config import ContextLengthError
from attnlens.model.native import library as native
from attnlens.model.parts import KVUpdate
from attnlens.model.parts.attention import InPlaceDecode

BLOCK = 64  # positions per block: at most 63 positions of memory a row holds unused (bench/README.md)
_SMALL_POOL = 64 << 20  # below this the pool is zero-filled up front (it may come from the heap) and kept


# --- a forward call's rows (every row cache's contract: model/kv_cache.py's KVCache too) ----------

@dataclass
class CacheWrite:
    """What one forward call over `rows` with T new tokens needs from the cache."""

    cache: Any  # the cache whose `update` stores a layer's keys and values: KVCache or PagedKVCache
    rows: slice
    start: int  # where the call's tokens go when every row has the same length (else -1)
    positions: torch.Tensor | None  # (B, T) absolute position of each new token when lengths differ
    mask: torch.Tensor | None  # (B, 1, T, S) True = may attend; None when plain causality covers it
    n_keys: int  # S = max(starts) + T
    slots: torch.Tensor | None = None  # (B*K*T,) where each new key goes in a layer's flat (R*K*P, D) view
    narrowed: bool = False  # the family narrowed the rows' mask (a sliding window)

    def layer(self, index: int) -> KVUpdate:
        return functools.partial(self.cache.update, self, index)


def rows_of(rows: slice | None, batch: int, n_rows: int) -> slice:
    """A call's rows as a plain slice (rows 0 .. batch-1 by default), checked against its batch."""
    rows = slice(0, batch) if rows is None else rows
    start, stop, step = rows.indices(n_rows)
    if step != 1 or stop - start != batch:
        raise ValueError(f"rows {rows} do not match a batch of {batch}")
    return slice(start, stop)


def keys_seen(starts: list[int], n_new: int, capacity: int) -> int:
    """S, the keys the call's queries see (the longest row's and its new tokens); a
    ContextLengthError when they do not fit the context."""
    S = max(starts) + n_new
    if S > capacity:
        raise ContextLengthError(f"sequence of {S} tokens exceeds the context length {capacity}")
    return S


def new_positions(starts: list[int], n_new: int) -> torch.Tensor:
    """(B, T): token t of row b goes to position starts[b] + t."""
    return torch.tensor(starts)[:, None] + torch.arange(n_new)[None, :]


def rows_mask(positions: torch.Tensor, n_keys: int) -> torch.Tensor:
    """(B, 1, T, S) for rows of different lengths: the query at position p sees keys 0 .. p (its own
    row's; the same for every head)."""
    return (torch.arange(n_keys)[None, None, :] <= positions[:, :, None])[:, None]


# --- the kernel's page advice, madvise(2) through libc: the pool's released blocks, and the weight
# arena's 2 MB pages (model/weight_arena.py) ---------------------------------------------------

DONTNEED = 4
HUGEPAGE = 14
NOHUGEPAGE = 15


def _madvise():
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


MADVISE = _madvise()


def advise_within(address: int, length: int, advice: int) -> bool:
    """madvise the whole pages within bytes address .. address + length."""
    page = mmap.PAGESIZE
    first, last = -(-address // page) * page, (address + length) // page * page
    if MADVISE is None or last <= first:
        return False
    return MADVISE(first, last - first, advice) == 0


# --- the cache in blocks -------------------------------------------------------------------------

class KVCacheFullError(RuntimeError):
    """Every block of the pool is held (the engine's admission keeps within the pool; this is for
    callers that do not)."""


def native_attention(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether a decode step's attention takes the C kernel (model/native/block_attention.c): float32
    on the CPU, a pool plane as laid out, no autograd, and the kernels built here."""
    return (q.dtype == torch.float32 and keys.dtype == torch.float32 and q.device.type == "cpu"
            and keys.is_contiguous() and not torch.is_grad_enabled() and native.available()[0])


def blocks_for(positions: int, block: int) -> int:
    """Blocks that hold `positions` positions."""
    return -(-positions // block)


class BlockAttention:
    """One decode step's attention over the pool's blocks, where they lie (shared by every layer).

    The step spans blocks lo .. hi-1 (every block of the call's rows; blocks of other rows or none
    between them are computed and dropped: `compact` keeps them few):
        owner (n,)        the call's row of each block, B for a block that is not the call's
        bias  (n*K, 1, P) 0 where a block's position is filled (this token's included), else -inf
        single            one row whose blocks are exactly lo .. hi-1: no row bookkeeping
    A block that is not the call's gets -inf everywhere, so its exp is NaN (-inf minus -inf): it
    lands in the dropped row B only. owner, bias and the maps' layout are built when the torch path
    first asks (the C kernel reads `table` and `lengths` alone).
    """

    def __init__(self, tables: list[list[int]], lengths: list[int], n_keys: int, table: torch.Tensor,
                 n_kv_heads: int, block: int, dtype: torch.dtype):
        self.tables, self.n_keys, self.K, self.P, self.dtype = tables, n_keys, n_kv_heads, block, dtype
        self.table, self.lengths = table, torch.tensor(lengths)  # (B, nb) block ids, (B,) positions: the C kernel's
        self.lo = min(min(t) for t in tables)
        self.hi = max(max(t) for t in tables) + 1
        self.single = len(tables) == 1 and tables[0] == list(range(self.lo, self.hi))

    @functools.cached_property
    def _bookkeeping(self) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The torch path's owner, bias and probs_index (the class docstring), built on its first use:
        the C kernel (and model/fused_decode.py) reads only the table and the lengths. probs_index:
        the call's blocks (offsets from lo, row by row) and, for each of their positions, its place in
        a (B, S_pad) row-major layout of the rows' probabilities (see probabilities)."""
        B, P, n = len(self.tables), self.P, self.hi - self.lo
        owner = torch.full((n,), B, dtype=torch.long)
        filled = torch.zeros(n, dtype=torch.long)  # positions of each block that are filled
        owned, flat = [], []
        for b, (t, length) in enumerate(zip(self.tables, self.lengths.tolist())):
            idx = torch.tensor(t) - self.lo
            owner[idx] = b
            filled[idx] = torch.clamp(length - torch.arange(len(t)) * P, 0, P)
            owned.append(idx)
            flat.append(b * blocks_for(self.n_keys, P) * P + torch.arange(len(t) * P))
        bias = torch.where(torch.arange(P)[None, :] < filled[:, None], 0.0, float("-inf")).to(self.dtype)  # (n, P)
        bias = bias[:, None, None, :].expand(n, self.K, 1, P).reshape(n * self.K, 1, P)
        return owner, bias, (torch.cat(owned), torch.cat(flat))

    @property
    def owner(self) -> torch.Tensor:
        return self._bookkeeping[0]

    @property
    def bias(self) -> torch.Tensor:
        return self._bookkeeping[1]

    @property
    def probs_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._bookkeeping[2]

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, want_probs: bool):
        """q (B, H, 1, D) over the pool's (N, K, P, D) keys and values: (B, H, 1, D) and, with
        want_probs, the (B, H, 1, S) probabilities (S = the longest row; 0 past a row's length)."""
        B, H, _, D = q.shape
        K, P = keys.shape[1], keys.shape[2]
        if native_attention(q, keys):
            return self.native(q, keys, values, scale, want_probs)
        G, n = H // K, self.hi - self.lo
        kb = keys[self.lo:self.hi].view(n * K, P, D)
        vb = values[self.lo:self.hi].view(n * K, P, D)
        qr = q.view(B, K, G, D)  # query head h = k * G + g reads key/value head k
        if self.single:
            qb = qr.expand(n, K, G, D).reshape(n * K, G, D)
        else:
            qb = torch.cat([qr, qr.new_zeros(1, K, G, D)]).index_select(0, self.owner).view(n * K, G, D)
        s = torch.baddbmm(self.bias, qb, kb.transpose(1, 2), alpha=scale).view(n, K, G, P)  # scores, masked
        if self.single:
            e = s.sub_(s.amax(dim=(0, 3), keepdim=True)).exp_()  # (n, K, G, P)
            total = e.sum(dim=(0, 3))[None]  # (1, K, G)
            y = torch.bmm(e.view(n * K, G, P), vb).view(n, K, G, D).sum(0, keepdim=True)  # (1, K, G, D)
            owner_total = total.expand(n, K, G) if want_probs else None
        else:
            rows = self.owner[:, None, None].expand(n, K, G)
            top = torch.full((B + 1, K, G), float("-inf"), dtype=s.dtype).scatter_reduce_(0, rows, s.amax(-1), "amax")
            e = s.sub_(top.index_select(0, self.owner)[..., None]).exp_()  # (n, K, G, P)
            total = torch.zeros(B + 1, K, G, dtype=s.dtype).index_add_(0, self.owner, e.sum(-1))
            o = torch.bmm(e.view(n * K, G, P), vb).view(n, K, G, D)
            y = torch.zeros(B + 1, K, G, D, dtype=s.dtype).index_add_(0, self.owner, o)[:B]
            total = total[:B]
            owner_total = torch.cat([total, total.new_ones(1, K, G)]).index_select(0, self.owner) if want_probs else None
        y = (y / total[..., None]).view(B, H, 1, D)
        if owner_total is None:  # the maps were not asked for
            return y, None
        return y, self.probabilities(e / owner_total[..., None], B, H)

    def native(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, want_probs: bool):
        """__call__ by model/native/block_attention.c: each (row, head) reads its blocks where they lie."""
        B, H, _, D = q.shape
        K, P = keys.shape[1], keys.shape[2]
        qc = q.reshape(B, H, D).contiguous()
        out = torch.empty(B, H, 1, D, dtype=q.dtype)
        probs = torch.empty(B, H, 1, self.n_keys, dtype=q.dtype) if want_probs else None
        failed = native.load().block_attention(
            qc.data_ptr(), keys.data_ptr(), values.data_ptr(), self.table.data_ptr(), self.table.shape[1],
            self.lengths.data_ptr(), B, H, K, P, D, scale, out.data_ptr(), 0 if probs is None else probs.data_ptr(),
            self.n_keys)
        if failed:
            raise MemoryError("block_attention: out of memory")
        return out, probs

    def probabilities(self, p: torch.Tensor, B: int, H: int) -> torch.Tensor:
        """Blocks' (n, K, G, P) probabilities -> each row's (B, H, 1, S), in position order."""
        blocks, flat = self.probs_index
        n_owned, K, G, P = len(blocks), p.shape[1], p.shape[2], p.shape[3]
        S_pad = blocks_for(self.n_keys, P) * P
        src = p.index_select(0, blocks).permute(1, 2, 0, 3).reshape(K * G, n_owned * P)  # (H, owned*P)
        out = torch.zeros(K * G, B * S_pad, dtype=p.dtype).index_copy_(1, flat, src)
        return out.view(H, B, S_pad).transpose(0, 1)[:, :, None, :self.n_keys]  # (B, H, 1, S)


class PagedLayer(InPlaceDecode):
    """Layer `index`'s view of a call (model/parts/attention.py's KVUpdate, and the in-place decode)."""

    def __init__(self, write: "PagedWrite", index: int):
        self.write, self.index = write, index

    def __call__(self, k: torch.Tensor, v: torch.Tensor):
        return self.write.cache.update(self.write, self.index, k, v)

    def decode_in_place(self, q, k, v, scale: float, want_probs: bool):
        """Store this step's keys/values, then attend over the blocks: (B, H, 1, D), probs or None.
        None when the call is not a decode step (the caller uses __call__)."""
        w = self.write
        if w.blocks is None or w.narrowed:  # a family that narrows the rows' mask (a window) gets the gathered path
            return None
        w.cache.store(w, self.index, k, v)
        return w.blocks(q, w.cache.keys[self.index], w.cache.values[self.index], scale, want_probs)


@dataclass
class PagedWrite(CacheWrite):
    fresh: bool = False  # every row starts at 0: the call's own keys are all it sees
    blocks: BlockAttention | None = None  # a decode step's attention over the blocks
    gather: torch.Tensor | None = None  # (B, nb) the rows' blocks, padded, for the gathered path

    def layer(self, index: int) -> PagedLayer:
        return PagedLayer(self, index)


class BlockTable:
    """Which blocks each row holds, and which are free (vLLM's block table and free-block queue):
    bookkeeping alone, no tensors. A row takes the block after its last one when that is free (a
    row is usually one run), else the lowest free one."""

    def __init__(self, n_rows: int, n_blocks: int, block: int):
        self.n_rows, self.n_blocks, self.block = n_rows, n_blocks, block
        self.lengths = torch.zeros(n_rows, dtype=torch.long)  # positions filled in each row
        self.tables: list[list[int]] = [[] for _ in range(n_rows)]
        self._free = set(range(n_blocks))
        self._lowest = list(range(n_blocks))  # a heap of free-block candidates (stale ones skipped)
        self._dirty: set[int] = set()  # free blocks written since their pages were last released

    @property
    def blocks_in_use(self) -> int:
        return self.n_blocks - len(self._free)

    def _take(self, after: int | None) -> int:
        """A free block: the one after `after` when free (a row stays one run), else the lowest."""
        if after is not None and after + 1 in self._free:
            b = after + 1
        else:
            while self._lowest and self._lowest[0] not in self._free:
                heapq.heappop(self._lowest)
            if not self._lowest:
                raise KVCacheFullError(f"the KV cache's {self.n_blocks} blocks are all held")
            b = heapq.heappop(self._lowest)
        self._free.discard(b)
        return b

    def _give(self, blocks: list[int]) -> None:
        for b in blocks:
            self._free.add(b)
            self._dirty.add(b)
            heapq.heappush(self._lowest, b)

    def reserve(self, row: int, positions: int) -> None:
        """Blocks for `positions` positions in `row` (taking more as needed)."""
        table = self.tables[row]
        for _ in range(blocks_for(positions, self.block) - len(table)):
            table.append(self._take(table[-1] if table else None))

    def shrink(self, row: int) -> None:
        """Give back the blocks past the row's length (a right-padded prompt's padding)."""
        table, keep = self.tables[row], blocks_for(int(self.lengths[row]), self.block)
        if len(table) > keep:
            self._give(table[keep:])
            del table[keep:]

    def free(self, row: int) -> None:
        """Forget a row's tokens; its blocks go back."""
        self._give(self.tables[row])
        self.tables[row] = []
        self.lengths[row] = 0

    def move(self, src: int, dst: int) -> None:
        """Row src becomes row dst (dst's own blocks go back): its table moves."""
        if src == dst:
            return
        self.free(dst)
        self.tables[dst], self.tables[src] = self.tables[src], []
        self.lengths[dst] = self.lengths[src]
        self.lengths[src] = 0

    def scattered(self) -> bool:
        """Whether the blocks in use span twice their number and more, or a lone row is not one run."""
        held = [t for t in self.tables if t]
        if not held:
            return False
        span = max(max(t) for t in held) + 1 - min(min(t) for t in held)
        used = sum(len(t) for t in held)
        lone = len(held) == 1 and held[0] != list(range(held[0][0], held[0][0] + len(held[0])))
        return lone or span > 2 * used + 4

    def pack(self) -> list[int]:
        """Renumber every row's blocks into one packed run from block 0, each row one run. Returns
        the old block of each new one (0, 1, ...), for the pool to move their contents; [] when
        they are packed already."""
        order = [(row, t) for row, t in enumerate(self.tables) if t]
        src = [b for _, t in order for b in t]
        if src == list(range(len(src))):
            return []
        self._dirty |= set(src) - set(range(len(src)))
        start = 0
        for row, t in order:
            self.tables[row] = list(range(start, start + len(t)))
            start += len(t)
        self._free = set(range(start, self.n_blocks))
        self._lowest = list(range(start, self.n_blocks))
        return src

    def take_dirty_free(self) -> list[int]:
        """The free blocks written since the last call, in order (their pages may go back)."""
        dirty = sorted(self._dirty & self._free)
        self._dirty.clear()
        return dirty


class BlockPool:
    """Every block's keys and values, every layer, in one allocation (N blocks of K heads x P
    positions x D): where the blocks' tensors live. The operating system backs it only where
    blocks have been written; `release` hands pages of blocks back."""

    def __init__(self, n_layers: int, n_blocks: int, n_kv_heads: int, block: int, d_head: int, *,
                 device: torch.device, dtype: torch.dtype, block_bytes: int):
        self.n_layers, self.n_blocks = n_layers, n_blocks
        self.block_elements = n_kv_heads * block * d_head
        shape = (n_layers, 2, n_blocks, n_kv_heads, block, d_head)
        small = n_blocks * block_bytes < _SMALL_POOL or device.type != "cpu"
        # torch.empty of a large size is fresh anonymous memory: zero, and backed only where written
        self._storage = (torch.zeros if small else torch.empty)(shape, dtype=dtype, device=device)
        self.releases = not small and MADVISE is not None
        if self.releases:
            # small pages: a 2 MB huge page (THP_MEM_ALLOC_ENABLE, app/cli/commands.py) would hold ~40 blocks of
            # one layer's keys, so a one-block row would keep 2 MB of each of the 2 x layers planes
            self._advise(0, self._storage.numel() * self._storage.element_size(), NOHUGEPAGE)
        self.keys = [self._storage[i, 0] for i in range(n_layers)]  # (N, K, P, D) views
        self.values = [self._storage[i, 1] for i in range(n_layers)]

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put (B, K, T, D) keys/values in their slots (flat (block, head, position) indices)."""
        D = k.shape[-1]
        self.keys[layer].view(-1, D).index_copy_(0, slots, k.reshape(-1, D))
        self.values[layer].view(-1, D).index_copy_(0, slots, v.reshape(-1, D))

    @staticmethod
    def gathered(plane: torch.Tensor, table: torch.Tensor, n_keys: int) -> torch.Tensor:
        """The rows' blocks (table: (B, nb) block ids) of one (N, K, P, D) plane as (B, K, S, D), in
        position order."""
        B, nb = table.shape
        K, P, D = plane.shape[1:]
        blocks = plane.index_select(0, table.reshape(-1).to(plane.device))  # (B*nb, K, P, D)
        return blocks.view(B, nb, K, P, D).transpose(1, 2).reshape(B, K, nb * P, D)[:, :, :n_keys]

    def move_blocks(self, src: list[int]) -> None:
        """Block src[i]'s contents to block i, every plane (via a copy: they may overlap)."""
        index = torch.tensor(src, device=self._storage.device)
        for plane in self.keys + self.values:
            plane[: len(src)] = plane.index_select(0, index)

    def release(self, blocks: list[int]) -> bool:
        """Hand the pages of these (sorted, free) blocks back to the system (they read as zeros
        after). Whether any went back."""
        if not blocks or not self.releases:
            return False
        element = self._storage.element_size()
        runs, start = [], blocks[0]
        for a, b in zip(blocks, blocks[1:] + [-1]):  # -1: past the last, which ends the last run
            if b != a + 1:
                runs.append((start, a + 1))
                start = b
        for plane in range(2 * self.n_layers):
            for lo, hi in runs:
                start = (plane * self.n_blocks + lo) * self.block_elements * element
                self._advise(start, (hi - lo) * self.block_elements * element, DONTNEED)
        return True

    def _advise(self, start: int, length: int, advice: int) -> None:
        """madvise the whole pages within bytes start .. start+length of the pool."""
        advise_within(self._storage.data_ptr() + start, length, advice)


class PagedKVCache:
    """The KV cache in blocks (the module docstring): a BlockTable (which blocks each row holds)
    over a BlockPool (the blocks' keys and values); the engine's on the CPU."""

    def __init__(self, n_layers: int, n_rows: int, n_kv_heads: int, capacity: int, d_head: int, *,
                 device=None, dtype=None, pool_bytes: int | None = None, block: int = BLOCK):
        self.n_layers, self.n_kv_heads, self.d_head = n_layers, n_kv_heads, d_head
        self.dtype = dtype if dtype is not None else torch.get_default_dtype()
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.n_rows, self.capacity, self.block = n_rows, capacity, block
        element = torch.empty((), dtype=self.dtype).element_size()
        self.block_bytes = 2 * n_layers * n_kv_heads * block * d_head * element  # keys and values, every layer
        context_blocks = blocks_for(capacity, block)
        wanted = pool_bytes // self.block_bytes if pool_bytes is not None else n_rows * context_blocks
        self.n_blocks = max(int(wanted), context_blocks)  # one whole context always fits
        self.table = BlockTable(n_rows, self.n_blocks, block)
        self.pool = BlockPool(n_layers, self.n_blocks, n_kv_heads, block, d_head, device=self.device,
                              dtype=self.dtype, block_bytes=self.block_bytes)

    # the table's and the pool's state, as every cache names it
    @property
    def lengths(self) -> torch.Tensor:
        return self.table.lengths

    @property
    def tables(self) -> list[list[int]]:
        return self.table.tables

    @property
    def keys(self) -> list[torch.Tensor]:
        return self.pool.keys

    @property
    def values(self) -> list[torch.Tensor]:
        return self.pool.values

    # --- memory --------------------------------------------------------------
    @property
    def blocks_in_use(self) -> int:
        return self.table.blocks_in_use

    @property
    def bytes_held(self) -> int:
        return self.blocks_in_use * self.block_bytes

    def bytes_for(self, rows: int, positions: int) -> int:
        """Bytes of keys and values for `rows` rows of `positions` each, in whole blocks."""
        return rows * blocks_for(positions, self.block) * self.block_bytes

    def bytes_for_lengths(self, lengths: list[int]) -> int:
        """Bytes for rows of these lengths: what admitting them may come to hold."""
        return sum(blocks_for(n, self.block) for n in lengths) * self.block_bytes

    def reserve(self, row: int, positions: int) -> None:
        """Blocks for `positions` positions in `row` (taking more as needed)."""
        self.table.reserve(row, positions)

    def trim(self, active_rows: int) -> bool:
        """Rows active_rows .. are free: pack the remaining rows when they are scattered, and give
        the pages of the free blocks back to the system. Whether any went back."""
        for row in range(active_rows, self.n_rows):
            if self.table.tables[row]:
                self.free(row)
        if self.table.scattered():
            self.compact()
        return self.release()

    def compact(self) -> None:
        """Move every row's blocks into one packed run from block 0, each row one run."""
        src = self.table.pack()
        if src:
            self.pool.move_blocks(src)

    def release(self) -> bool:
        """Hand the pages of free, written blocks back to the system (they read as zeros after)."""
        return self.pool.release(self.table.take_dirty_free())

    # --- one forward call ----------------------------------------------------
    def row_slice(self, rows: slice | None, batch: int) -> slice:
        return rows_of(rows, batch, self.n_rows)

    def begin(self, rows: slice | None, batch: int, n_new: int) -> PagedWrite:
        """Blocks for n_new more tokens in every row; the call's positions, mask, slots and, for a
        decode step, its attention over the blocks."""
        rows = self.row_slice(rows, batch)
        starts = self.lengths[rows].tolist()  # (B,)
        longest = max(starts)
        S = keys_seen(starts, n_new, self.capacity)
        for row, start in zip(range(rows.start, rows.stop), starts):
            self.table.reserve(row, start + n_new)
        tables = [self.tables[r] for r in range(rows.start, rows.stop)]
        P, K = self.block, self.n_kv_heads
        positions = new_positions(starts, n_new)  # (B, T)
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [t[-1]] * (width - len(t)) for t in tables])  # (B, nb), padded with a real block
        block_of = table.gather(1, positions // P)  # (B, T)
        heads = torch.arange(K)[None, :, None]
        slots = ((block_of[:, None, :] * K + heads) * P + (positions % P)[:, None, :]).reshape(-1)  # (B*K*T,)
        same = min(starts) == longest
        mask = None if same else rows_mask(positions, S)
        blocks = (BlockAttention(tables, [s + n_new for s in starts], S, table, K, P, self.dtype)
                  if n_new == 1 else None)
        return PagedWrite(self, rows, longest if same else -1, None if same else positions, mask, S, slots,
                          fresh=longest == 0, blocks=blocks, gather=table)

    def store(self, write: PagedWrite, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put the call's (B, K, T, D) keys/values in their slots."""
        self.pool.store(layer, write.slots, k, v)

    def update(self, write: PagedWrite, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store (B, K, T, D) keys/values; return the (B, K, S, D) keys/values the queries see."""
        self.store(write, layer, k, v)
        if write.fresh:  # a prompt from position 0 sees its own keys alone
            return k, v
        return self._gathered(self.keys[layer], write), self._gathered(self.values[layer], write)

    def _gathered(self, plane: torch.Tensor, write: PagedWrite) -> torch.Tensor:
        """The rows' blocks of one (N, K, P, D) plane as (B, K, S, D), in position order."""
        assert write.gather is not None  # begin() sets it on every call
        return self.pool.gathered(plane, write.gather, write.n_keys)

    def commit(self, write: PagedWrite, n_new: int | torch.Tensor) -> None:
        """Advance the rows by n_new tokens (an int, or (B,) per row when rows were right-padded);
        the padding's blocks go back."""
        self.lengths[write.rows] += n_new
        if not isinstance(n_new, int):
            for row in range(write.rows.start, write.rows.stop):
                self.table.shrink(row)

    # --- rows ----------------------------------------------------------------
    def free(self, row: int) -> None:
        """Forget a row's tokens; its blocks go back to the pool."""
        self.table.free(row)

    def move(self, src: int, dst: int) -> None:
        """Row src becomes row dst (dst's own blocks go back): its table moves, not its keys."""
        self.table.move(src, dst)

    def reset(self) -> None:
        for row in range(self.n_rows):
            self.free(row)
