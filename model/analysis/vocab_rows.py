"""Per-row statistics over the vocabulary, for the logit lens and the logits report: top-k, a
chosen token's log-probability and rank, a slice of rows at a time.

The lens unembeds (L + 1) * P rows (P positions). At once, that is (L + 1) * P * V floats (800 MB
for a 24-layer model with a 152K vocabulary over 256 positions). The unembedding runs a block of
rows at a time (BLOCK_FLOATS logits, 16 MiB: 85 of SmolLM2's rows, ~50 ms on 2 cores, which a stream
decoding beside the lens waits at most): the head's (V, C) weights (113 MB for SmolLM2) are read
once per block, not once per small slice, which made SmolLM2's lens 4x slower. Within a
block, the statistics: on the CPU, where our C kernels are built, model/native/vocab_stats.c takes
the whole block, two passes over each row while it is in cache (the top k and the rank's count,
then the sum of exponentials; no (n, V) log-probabilities written). Elsewhere, or for a row with
a NaN or an infinite maximum, torch's operations take a slice of rows at a time (SLICE_FLOATS, 4
MiB), each pass reading what the one before left in cache: top-k from a striped candidate search,
the rank (only when asked) counted as float ones, one fused log_softmax (bench/bench_explain.py
measures the lens beside a prefill).

    row_slices(n, V, floats)    slices of rows with about `floats` logits each (SLICE_FLOATS)
    unembedded_stats(unembed, rows, picks, V, k, rank)
                                next_token_stats of unembed(rows), block by block, slice by slice
    top_k(x, k)                 (values, ids) of the k largest per row of (N, V), as torch.topk
    count_greater(x, floor)     (N,) how many entries of each row are strictly above floor (N, 1)
    next_token_stats(logits, picks, k)
                                one slice's log-probabilities: the top k, the picked id's, its rank
    native_stats(logits, picks, k, rank)
                                the same from the C kernel (None where it does not apply)
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

import torch

from attnlens.model.native import library as native

SLICE_FLOATS = 1 << 20  # 4 MiB of float32 logits per slice: few enough calls, each within the L2 and L3 caches
BLOCK_FLOATS = 1 << 22  # 16 MiB of float32 logits per unembedding: the head's weights read once a block
STRIPES = 8  # top_k's candidate search: ids split into STRIPES stripes of V // STRIPES columns


def row_slices(n_rows: int, vocab: int, floats: int = SLICE_FLOATS) -> list[slice]:
    step = max(1, floats // max(1, vocab))
    return [slice(s, min(s + step, n_rows)) for s in range(0, n_rows, step)]


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of each row of x (N, V), descending, and their ids: torch.topk's answer
    (the order among exactly equal entries aside) at about a third of its cost on the CPU.

    The ids are laid out as STRIPES stripes of w = V // STRIPES columns (id = stripe * w + column;
    ids past STRIPES * w are always candidates). A column's best is its largest entry over the
    stripes. Every one of the row's k largest entries lies in one of the k columns with the largest
    bests: were it in another column, those k columns' bests would be k other entries, each at least
    as large, and it would not be among the k largest. So the k largest are found among those
    columns' k * STRIPES entries.
    """
    n, vocab = x.shape
    k = min(k, vocab)
    w = vocab // STRIPES
    if w < 4 * k:  # a small vocabulary: nothing to save
        return torch.topk(x, k, dim=-1)
    grid = x[:, : w * STRIPES].unflatten(1, (STRIPES, w))  # (N, STRIPES, w), a view
    columns = torch.topk(grid.amax(dim=1), k, dim=-1).indices  # (N, k)
    stripes = torch.arange(STRIPES, device=x.device) * w  # (STRIPES,)
    candidates = (columns[:, :, None] + stripes).flatten(1)  # (N, k * STRIPES)
    if w * STRIPES < vocab:
        rest = torch.arange(w * STRIPES, vocab, device=x.device).expand(n, -1)  # (N, V mod STRIPES)
        candidates = torch.cat([candidates, rest], dim=1)
    best = torch.topk(x.gather(1, candidates), k, dim=-1)
    return best.values, candidates.gather(1, best.indices)


def count_greater(x: torch.Tensor, floor: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """(N,) int64: per row of x (N, V), the entries strictly greater than floor (N, 1). Counted as
    float ones written into `scratch` (like x; exact below 2**24 entries), which the CPU sums faster
    than booleans."""
    ones = torch.gt(x, floor, out=torch.empty_like(x) if scratch is None else scratch)
    return ones.sum(dim=-1).long()


@dataclass
class NextTokenStats:
    top_logprobs: torch.Tensor  # (N, k) descending
    top_ids: torch.Tensor  # (N, k)
    picked_logprob: torch.Tensor  # (N,) the log-probability of the picked id
    picked_rank: torch.Tensor | None  # (N,) ids strictly more likely than the picked one (0: the top); None: not asked


def native_stats(logits: torch.Tensor, picks: torch.Tensor, k: int, rank: bool = True) -> NextTokenStats | None:
    """next_token_stats's answer from model/native/vocab_stats.c, for float32 CPU logits (N, V) and
    picks (N, 1) in 0..V-1; None where the kernel does not apply (another device or dtype, no C
    kernels on this machine, a row with a NaN or an infinite maximum): the caller uses torch's."""
    if (logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2 or logits.requires_grad
            or not native.available()[0]):
        return None
    N, V = logits.shape
    k = min(max(1, k), V)
    x = logits.contiguous()
    chosen = picks.reshape(-1).to(torch.long).contiguous()
    if N == 0 or V == 0 or chosen.numel() != N or int(chosen.min()) < 0 or int(chosen.max()) >= V:
        return None
    top = torch.empty(N, k)
    ids = torch.empty(N, k, dtype=torch.long)
    picked = torch.empty(N)
    ranks = torch.empty(N, dtype=torch.long) if rank else None
    bad = native.load().vocab_stats(x.data_ptr(), N, V, chosen.data_ptr(), k, top.data_ptr(), ids.data_ptr(),
                                    picked.data_ptr(), 0 if ranks is None else ranks.data_ptr())
    return None if bad else NextTokenStats(top, ids, picked, ranks)


def next_token_stats(logits: torch.Tensor, picks: torch.Tensor, k: int, rank: bool = True) -> NextTokenStats:
    """For logits (N, V) and picks (N, 1) ids: the top k log-probabilities and the picked id's, and
    (with `rank`) its rank, by torch's operations. Log-probabilities come from one log_softmax
    (PyTorch's fused kernel: at one thread it costs about half the separate subtract, exp and sum
    passes over the slice); ranks compare the logits themselves."""
    x = logits.float()
    _, ids = top_k(x, max(1, k))  # (N, k)
    ranks = count_greater(x, x.gather(1, picks)) if rank else None
    logp = torch.log_softmax(x, dim=-1)  # (N, V)
    return NextTokenStats(logp.gather(1, ids[:, :k]), ids[:, :k], logp.gather(1, picks)[:, 0], ranks)


def cat_stats(parts: list[NextTokenStats]) -> NextTokenStats:
    """One NextTokenStats from the slices' (in row order)."""
    def cat(name):
        got = [getattr(p, name) for p in parts]
        return None if got[0] is None else torch.cat(got)
    return NextTokenStats(*(cat(f.name) for f in fields(NextTokenStats)))


def unembedded_stats(unembed, rows: torch.Tensor, picks: torch.Tensor, vocab: int, k: int,
                     rank: bool = True, progress: Callable[[], None] | None = None) -> NextTokenStats:
    """next_token_stats of unembed(rows) (N, vocab) for rows (N, C) and picks (N, 1): unembedded a
    block of rows at a time (BLOCK_FLOATS logits), the statistics of a block by the C kernel, or
    by torch a slice of the block at a time; `progress` is called after each block."""
    parts = []
    for block in row_slices(len(rows), vocab, BLOCK_FLOATS):
        logits = unembed(rows[block])  # (n, V)
        done = native_stats(logits, picks[block], k, rank) if k > 0 else None
        if done is None:
            parts += [next_token_stats(logits[s], picks[block][s], k, rank) for s in row_slices(len(logits), vocab)]
        else:
            parts.append(done)
        if progress is not None:
            progress()
    return cat_stats(parts)
