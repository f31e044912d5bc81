"""What a served model holds in memory (its weights and its KV cache), and how many KV-cache rows
(generations decoded at once) a memory budget allows.

On the CPU a decoder's KV cache is handed out in blocks from one pool (model/paged_kv_cache.py):
there the budget ATTNLENS_KV_CACHE_BYTES (default 1 GiB a model) is the pool, memory follows the
tokens in flight, every MAX_CONCURRENT slot stays open, and prompts wait while the reservations
of the generations in flight fill it (app/engine/core.py).
Elsewhere (CUDA, the encoder-decoder) the rows are allocated whole, as below.

A row of a generating model's KV cache holds keys and values for every layer over the whole
context: 2 x layers x kv heads x context x d_head x the dtype's bytes (an encoder-decoder adds
the cross-attention keys and values of a row's source). For the bundled decoder in float32 that
is 2 MB a row; for a 1 B-parameter Llama-shaped model at a context of 2,048 in bfloat16 it is
about 64 MB, so 32 rows are 2 GB: ATTNLENS_KV_CACHE_BYTES caps it, and the rows follow.
"""

from __future__ import annotations

import torch

from attnlens.model.kv_cache import cache_paged

__all__ = ["cache_paged", "cache_row_bytes", "cache_rows", "weight_bytes"]


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each tensor counted once (tied weights too)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = id(t) if t.is_meta else t.data_ptr()  # meta tensors (shapes alone) have no data to share
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def cache_row_bytes(model) -> int:
    """Bytes of one row of the model's KV cache, as its family computes them (a row of a long-context
    model can be gigabytes: it is never allocated to be measured)."""
    return model.kv_cache_row_bytes()


def cache_rows(name: str, row_bytes: int, max_concurrent: int, budget: int | None, *, paged: bool = False) -> int:
    """Rows (generations decoded together) for a model: MAX_CONCURRENT, or fewer if the budget
    holds fewer whole rows (a cache in blocks needs room for one); a budget that holds no row at all
    is a start-up error naming the numbers."""
    if budget is None:
        return max_concurrent
    whole = budget // row_bytes
    rows = max_concurrent if paged and whole >= 1 else min(max_concurrent, whole)
    if rows < 1:
        raise RuntimeError(f"ATTNLENS_KV_CACHE_BYTES={budget} holds no row of model {name!r}'s KV cache "
                           f"(one row, a whole context of keys and values, is {row_bytes / 2**20:.1f} MB)")
    return rows
