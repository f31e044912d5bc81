"""The packed-weights kernel (packed_matmul.c), compiled once per machine and called through ctypes.

Why our own kernel: torch's weight-only kernels fit two of the three formats on paper
(`_weight_int4pack_mm_for_cpu`: groups of 32 with a scale and a zero, exactly Q4_0 and Q4_1;
`_weight_int8pack_mm`: one scale per row, not Q8_0's one per block), but on this 2-core AVX2
machine (torch 2.13, bench/README.md) the int4 one is 7-8x slower than the float32 product it
would replace at one row, the int8 one 3.7x: they would make decoding slower, not faster.

The source is compiled by the system C compiler (`cc`, or $CC) with -O3 -march=native -fopenmp
into `<cache>/kernels/packed_matmul-<hash>.so` (the hash covers the source, the compiler's
version and the flags, so a new source or compiler builds again), atomically, once; later
processes load that file. The library links libgomp.so.1, the OpenMP runtime torch has already
loaded, so its threads are torch's threads (torch.set_num_threads applies).

    available()            whether the kernel can be built and loaded here, and if not why
    matmul(x, w, fmt, K)   (..., K) float32 x packed (N, row_bytes) -> (..., N)
    dequantize(w, fmt, K)  packed rows (all, or `rows`) -> float32 (R, K)
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("packed_matmul.c")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]
FORMATS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}  # the codes packed_matmul.c takes
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # bytes per block of 32 weights

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None


class KernelUnavailable(RuntimeError):
    """The packed kernel cannot be built or loaded on this machine (the message says why)."""


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _library_path(cc: str) -> Path:
    from attnlens.resources import cache_root

    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256(SOURCE.read_bytes() + version.encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"packed_matmul-{digest}.so"


def _build(cc: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        partial = Path(tmp) / out.name
        done = subprocess.run([cc, *FLAGS, "-o", str(partial), str(SOURCE)], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            raise KernelUnavailable(f"{cc} could not compile {SOURCE.name}: {done.stderr.strip()[-400:]}")
        partial.replace(out)  # atomic: a concurrent process loads a whole file or builds its own


def _load() -> ctypes.CDLL:
    global _library, _failure
    with _lock:
        if _library is not None:
            return _library
        if _failure is not None:
            raise KernelUnavailable(_failure)
        try:
            cc = _compiler()
            if cc is None:
                raise KernelUnavailable("packed weights need a C compiler to build their kernel once "
                                        "(none found: install gcc, or set CC)")
            path = _library_path(cc)
            if not path.is_file():
                _build(cc, path)
            lib = ctypes.CDLL(str(path))
        except KernelUnavailable as e:
            _failure = str(e)
            raise
        except (OSError, subprocess.SubprocessError) as e:
            _failure = f"the packed kernel cannot be built or loaded: {e}"
            raise KernelUnavailable(_failure) from e
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.packed_matmul.argtypes = [ptr, i64, i64, ptr, i64, ctypes.c_int, ptr]
        lib.packed_matmul.restype = ctypes.c_int
        lib.packed_dequantize.argtypes = [ptr, i64, ctypes.c_int, ptr, i64, ptr]
        lib.packed_dequantize.restype = None
        _library = lib
        return lib


def available() -> tuple[bool, str]:
    """(True, "") when the kernel is built and loaded (building it if needed), else (False, why)."""
    try:
        _load()
        return True, ""
    except KernelUnavailable as e:
        return False, str(e)


def matmul(x: torch.Tensor, w: torch.Tensor, fmt: str, K: int) -> torch.Tensor:
    """x (..., K) float32 on the CPU times the packed matrix w (N, K/32 blocks as uint8) transposed:
    (..., N), as F.linear(x, dequantize(w)) up to the order of the sums."""
    lib = _load()
    lead = x.shape[:-1]
    rows = x.reshape(-1, K).contiguous()  # (M, K)
    M, N = rows.shape[0], w.shape[0]
    y = torch.empty(M, N, dtype=torch.float32)
    if lib.packed_matmul(rows.data_ptr(), M, K, w.data_ptr(), N, FORMATS[fmt], y.data_ptr()) != 0:
        raise MemoryError("packed_matmul: out of memory")
    return y.view(*lead, N)


def dequantize(w: torch.Tensor, fmt: str, K: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of the packed matrix w (all, or the int64 `rows`) as float32 (R, K), exactly as gguf's
    dequantizer computes them."""
    lib = _load()
    if rows is not None:
        rows = rows.reshape(-1).to(torch.int64).contiguous()
    R = w.shape[0] if rows is None else rows.numel()
    out = torch.empty(R, K, dtype=torch.float32)
    lib.packed_dequantize(w.data_ptr(), K, FORMATS[fmt], None if rows is None else rows.data_ptr(), R,
                          out.data_ptr())
    return out
