"""Our C kernels (this folder's *.c), compiled once per machine into one library and loaded with ctypes.

    packed_matmul.c     products with weights in GGUF blocks (model/packed/kernel.py)
    block_attention.c   a decode step's attention over a KV cache in blocks (model/paged_kv_cache.py)
    causal_attention.c  a prefill's causal attention, flash-style in tiles (model/parts/causal_attention.py)
    float_matvec.c      a few rows times a float32 weight (model/parts/linear.py)
    rms_norm.c          RMSNorm of float32 rows, a prefill's shared by the threads (model/parts/norms.py)
    swiglu.c            SwiGLU's silu(gate) * up in one pass (model/parts/feedforward.py)
    rotary.c            rotary positions on a prefill's queries and keys in one pass (model/parts/positions.py)
    decode_layers.c     a decode step through every block of a Llama-like stack (model/fused_decode.py)
    vocab_stats.c       the logit lens's per-row top k, picked log-probability and rank (model/analysis/vocab_rows.py)
    vector_math.h       vector maths the sources share (e^x, 8 floats at a time)

The sources are compiled by the system C compiler (`cc`, or $CC) with -O3 -march=native -fopenmp
into `<cache>/kernels/attnlens-<hash>.so` (the hash covers the sources and headers, the compiler's version, the
flags and the processor: a new source, compiler or CPU builds again), atomically, once; later
processes load that file. The library links libgomp.so.1, the OpenMP runtime torch has already loaded, so its threads
are torch's (torch.set_num_threads applies). ctypes releases the GIL for each call.

Where no compiler is found, or it fails, `available()` says why and `load()` raises
NativeUnavailable with that reason; callers fall back to torch or refuse with it.
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

from attnlens.resources import cache_root

SOURCES = sorted(Path(__file__).parent.glob("*.c"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))  # included by the sources
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None


class NativeUnavailable(RuntimeError):
    """The C kernels cannot be built or loaded on this machine (the message says why)."""


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu() -> str:
    """The processor's model and instruction-set flags (Linux): -march=native builds for them, so a cache
    shared with another machine (a home folder on NFS, an image's layer) never hands it a library
    with instructions its processor lacks."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return "\n".join(next((line for line in lines if line.startswith(key)), "") for key in ("model name", "flags"))


def library_path(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES + HEADERS) + version.encode()
                            + " ".join(FLAGS).encode() + _cpu().encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"attnlens-{digest}.so"


def _build(cc: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        partial = Path(tmp) / out.name
        done = subprocess.run([cc, *FLAGS, "-o", str(partial), *map(str, SOURCES), "-lm"], capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            raise NativeUnavailable(f"{cc} could not compile attnlens' C kernels: {done.stderr.strip()[-400:]}")
        partial.replace(out)  # atomic: a concurrent process loads a whole file or builds its own


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.packed_matmul.argtypes = [ptr, i64, i64, ptr, i64, ctypes.c_int, ptr]
    lib.packed_matmul.restype = ctypes.c_int
    lib.packed_dequantize.argtypes = [ptr, i64, ctypes.c_int, ptr, i64, ptr]
    lib.packed_dequantize.restype = None
    lib.block_attention.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, f32, ptr, ptr, i64]
    lib.block_attention.restype = ctypes.c_int
    lib.causal_attention.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, i64, i64, i64, i64, i64, f32, ptr]
    lib.causal_attention.restype = ctypes.c_int
    lib.float_matvec.argtypes = [ptr, i64, ptr, i64, ptr, ptr]
    lib.float_matvec.restype = None
    lib.rms_norm.argtypes = [ptr, i64, i64, ptr, f32, ptr]
    lib.rms_norm.restype = None
    lib.swiglu.argtypes = [ptr, i64, i64, ptr]
    lib.rotary.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr]
    lib.rotary.restype = None
    lib.swiglu.restype = None
    lib.float_matmul_few.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr]
    lib.float_matmul_few.restype = None
    lib.decode_layers.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, i64, ptr,
                                  i64, i64, f32, f32]
    lib.decode_layers.restype = ctypes.c_int
    lib.vocab_stats.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ptr, ptr]
    lib.vocab_stats.restype = i64


def load() -> ctypes.CDLL:
    """The library, built first if needed (NativeUnavailable, with the reason, when it cannot be)."""
    global _library, _failure
    with _lock:
        if _library is not None:
            return _library
        if _failure is not None:
            raise NativeUnavailable(_failure)
        try:
            cc = _compiler()
            if cc is None:
                raise NativeUnavailable("attnlens' C kernels need a C compiler to be built once "
                                        "(none found: install gcc, or set CC)")
            path = library_path(cc)
            if not path.is_file():
                _build(cc, path)
            lib = ctypes.CDLL(str(path))
            _declare(lib)
        except NativeUnavailable as e:
            _failure = str(e)
            raise
        except (OSError, subprocess.SubprocessError, AttributeError) as e:
            _failure = f"attnlens' C kernels cannot be built or loaded: {e}"
            raise NativeUnavailable(_failure) from e
        _library = lib
        return lib


def available() -> tuple[bool, str]:
    """(True, "") when the library is loaded (building it if needed), else (False, why)."""
    if _library is not None:  # the hot path: asked once per product of a decode step
        return True, ""
    if _failure is not None:  # and where there is no compiler, as often
        return False, _failure
    try:
        load()
        return True, ""
    except NativeUnavailable as e:
        return False, str(e)
