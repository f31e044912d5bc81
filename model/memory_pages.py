"""madvise(2) on ranges of tensors' memory: the kernel's page advice, through libc.

    advise_within(address, length, advice) -> bool   the whole pages inside the range; False where
                                                      libc's madvise is not there or refused
    DONTNEED, HUGEPAGE, NOHUGEPAGE                    Linux's advice values

The KV cache hands blocks no row holds back to the kernel (DONTNEED) and keeps its pool on small
pages (model/paged_kv_cache.py); the weight arena asks for 2 MB pages (model/weight_arena.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

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
