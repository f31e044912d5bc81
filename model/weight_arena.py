"""A CPU model's large weights in one buffer on 2 MB pages, in the order a forward reads them.

A decode step of a real model is its weights read once: SmolLM2-135M's 121 float32 matrices are 538
MB a token. How fast they stream decides the step, and two things about where they lie matter
(bench/README.md, issue 34; 2 threads on a 2-core Xeon, the 121 matrices cycled):

* pages: on 4 KB pages every 4 KB of a matrix is another TLB entry to walk for, and the products'
  prefetch 4 KB ahead (model/native/float_matvec.c, packed_matmul.c) walks into each page before
  the loads do; 2 MB pages take 1/512 of the walks. torch allocates each tensor on its own: even
  with its huge-page allocator (THP_MEM_ALLOC_ENABLE) only the 2 MB-aligned parts of large tensors
  get them (301 of SmolLM2's 538 MB);
* order: each matrix starts where the one read before it ends, so the prefetch running past the
  end of one product is already fetching the next one's first rows.

The products read 23 GB/s as torch allocated the weights and 30 GB/s from the arena.

    gather(model) -> bytes moved into the arena (0 where nothing qualified)
    gather(model, values=False)   the same, for weights a load is about to overwrite: nothing copied

Gathered: every float32 parameter and every packed matrix (model/packed/) of at least MIN_BYTES,
in module order (a block's attention products, then its feed-forward's; a tied head once, where
its embedding is). Parameters keep their objects (`param.data` is pointed at the arena), so
optimizers, hooks and state_dict see the same model; `save_checkpoint` stores copies. Replacing a
parameter later (`module.weight = nn.Parameter(...)`) takes that one out of the arena, nothing
else. The arena's pages are advised 2 MB (MADV_HUGEPAGE) before anything is written to them;
where the kernel has transparent huge pages off, they are small pages, in the same order.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from attnlens.model.packed.modules import PackedEmbedding, PackedLinear
from attnlens.model.paged_kv_cache import HUGEPAGE, advise_within  # madvise(2), the KV pool's too

MIN_BYTES = 64 << 10  # a norm's weight or a bias stays where it is
HUGE_PAGE = 2 << 20
ADVISE_FROM = 64 << 20  # smaller arenas may come from malloc's heap (app/engine/allocator.py), and fit in cache
ALIGN = 64  # each tensor starts on a cache line


def _members(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """(module, what, tensor) for each tensor to gather, in module order; a tensor two modules hold
    (a tied head) appears for each."""
    found = []
    for module in model.modules():
        if isinstance(module, (PackedLinear, PackedEmbedding)):
            candidates = [("packed", module.packed.data)]
        else:
            candidates = [(name, p) for name, p in module.named_parameters(recurse=False)
                          if p.dtype == torch.float32]
        for what, t in candidates:
            if t.device.type != "cpu" or not t.is_contiguous() or t.numel() * t.element_size() < MIN_BYTES:
                continue
            found.append((module, what, t))
    return found


def _place(module: nn.Module, what: str, view: torch.Tensor) -> None:
    if what == "packed":
        module.packed.data = view
        module._buffers["blocks"] = view  # the buffer is the packed matrix's tensor
    else:
        getattr(module, what).data = view


def gather(model: nn.Module, *, values: bool = True) -> int:
    """Move the model's large CPU weights into one arena (module docstring); their values are kept,
    unless `values` is False: for weights about to be overwritten (a load reads every one of them),
    the arena's pages are then first touched by that load, not by a copy of nothing."""
    members = _members(model)
    offsets: dict[int, int] = {}  # id(tensor) -> its byte offset in the arena
    total = 0
    for _, _, t in members:
        if id(t) not in offsets:
            offsets[id(t)] = total
            total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    if not total:
        return 0
    raw = torch.empty(total + HUGE_PAGE, dtype=torch.uint8)  # fresh anonymous memory: no page touched yet
    start = -raw.data_ptr() % HUGE_PAGE
    if total >= ADVISE_FROM:
        advise_within(raw.data_ptr() + start, total, HUGEPAGE)
    arena = raw[start:start + total]
    placed: dict[int, torch.Tensor] = {}
    for module, what, t in members:
        if id(t) not in placed:
            offset = offsets[id(t)]
            placed[id(t)] = arena[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            if values:
                placed[id(t)].copy_(t)
        _place(module, what, placed[id(t)])
    return total
