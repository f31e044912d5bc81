"""Giving freed heap pages back to the system: glibc's malloc_trim(0).

Large freed tensors (a finished long prompt's activations, an answer's buffers) otherwise stay in
the process's RSS. The engine trims after it hands KV blocks back (core.py) and when the stream
budget frees an answer (outputs.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util


def _malloc_trim():
    """glibc's malloc_trim(0), or None where there is none (musl, macOS)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


MALLOC_TRIM = _malloc_trim()


def trim() -> None:
    """Give the heap's free pages back to the system (a no-op without glibc)."""
    if MALLOC_TRIM is not None:
        MALLOC_TRIM(0)
