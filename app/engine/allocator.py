"""Keep the memory a forward frees for the next forward (glibc's malloc), instead of handing it back
to the kernel and faulting it in again.

A prefill's intermediates are large and short-lived: SmolLM2's 2,048-token forward allocates and
frees about a dozen tensors of 2-25 MB per layer. With glibc's defaults the largest go to mmap, and
freed memory at the heap's top past a threshold that follows them is returned to the kernel; the
next tensor faults the same pages in again, zeroed. Measured on this project's 2-core machine (one
process, 2 threads, SmolLM2's 2,048-token prefill, 5 in a row): 235-400 thousand page faults and
2.38-2.65 s a forward with the defaults; none and 2.19-2.32 s with both thresholds set here
(bench/README.md). Setting only the trim threshold is worse than the defaults (every large tensor
then goes to mmap: a million faults, 3.0 s): both are set, or neither.

    retain_freed_memory(n)   M_MMAP_THRESHOLD: blocks below MMAP_THRESHOLD come from the heap;
                             M_TRIM_THRESHOLD = n: up to n freed bytes at the heap's top stay
                             in the process. 0, or a C library that is not glibc: nothing changes.

The cost is resident memory: after a long prompt the process keeps up to n bytes it no longer
uses until a later forward reuses them (ATTNLENS_MALLOC_RETAIN_BYTES, 512 MiB by default).

    cap_arenas(n)            M_ARENA_MAX = n: at most n malloc arenas. glibc gives each thread
                             that allocates while others do an arena of its own (up to 8 per
                             core), and an arena keeps what it once held: the server's worker
                             threads, each new one taking a new arena, stepped its resident
                             memory up by ~15 MB at a time over a 20-minute soak (docs/performance.md).
                             Its Python runs one thread at a time anyway. 0: glibc's default.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("attnlens.engine")

M_TRIM_THRESHOLD = -1  # mallopt parameters, <malloc.h>
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 << 20  # glibc's largest dynamic threshold (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # only glibc has it (musl's mallopt does nothing)
        return libc
    except (OSError, AttributeError):
        return None


def retain_freed_memory(retain_bytes: int) -> bool:
    """Set glibc's thresholds (module docstring) for this process; True if they were set."""
    if retain_bytes <= 0:
        return False
    libc = _glibc()
    if libc is None:
        return False
    mmap_ok = libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(min(MMAP_THRESHOLD, retain_bytes)))
    trim_ok = libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(min(retain_bytes, 2**31 - 1)))
    if not (mmap_ok and trim_ok):
        log.warning("glibc refused the malloc thresholds (mmap %s, trim %s): freed memory goes back to the "
                    "kernel as by default", mmap_ok, trim_ok)
        return False
    return True


def cap_arenas(arenas: int) -> bool:
    """At most `arenas` malloc arenas in this process from now on (module docstring); True if set."""
    if arenas <= 0:
        return False
    libc = _glibc()
    if libc is None:
        return False
    if not libc.mallopt(M_ARENA_MAX, ctypes.c_int(arenas)):
        log.warning("glibc refused M_ARENA_MAX=%d: each thread may get an arena of its own", arenas)
        return False
    return True
