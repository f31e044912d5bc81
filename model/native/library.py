"""Our C kernels (this folder's *.c), compiled once per machine into one library and called through cffi.

    attnlens_kernels.h  their interface, declared once: every function the library exports, the structs they share
    packed_matmul.c     products with weights in GGUF blocks (model/packed/kernel.py)
    block_attention.c   a decode step's attention over a KV cache in blocks (model/paged_kv_cache.py)
    causal_attention.c  a prefill's causal attention, flash-style in tiles (model/parts/causal_attention.py),
                        and the same reducing some heads' maps from its scores (attention_maps.py)
    float_matvec.c      a few rows times a float32 weight (model/parts/linear.py)
    rms_norm.c          RMSNorm of float32 rows, a prefill's shared by the threads (model/parts/norms.py)
    swiglu.c            SwiGLU's silu(gate) * up in one pass (model/parts/feedforward.py)
    rotary.c            rotary positions on a prefill's queries and keys in one pass (model/parts/positions.py)
    decode_layers.c     a decode step through every block of a Llama-like stack (model/fused_decode.py)
    vocab_stats.c       the logit lens's per-row top k, picked log-probability and rank (model/analysis/vocab_rows.py)
    vector_math.h       vector maths the sources share (e^x, 8 floats at a time)

The interface is written once, in attnlens_kernels.h, because a copy that drifts corrupts memory
silently. Each source includes it, so the compiler checks every definition against its declaration
(and -Werror=missing-prototypes refuses an exported function the header lacks); `load()` hands
the same text to cffi (`ffi.cdef`, then `ffi.dlopen` of the built library: ABI mode, no second
compile), so Python repeats no signature or struct. tests/model/test_native_interface.py checks the
header against the sources' definitions and the built library.

The sources are compiled by the system C compiler (`cc`, or $CC) with -O3 -march=native -fopenmp
into `<cache>/kernels/attnlens-<hash>.so` (the hash covers the sources and headers, the compiler's version, the
flags and the processor: a new source, header, compiler or CPU builds again), atomically, once; later
processes load that file. The library links libgomp.so.1, the OpenMP runtime torch has already loaded, so its threads
are torch's (torch.set_num_threads applies). cffi releases the GIL for each call, as ctypes did.

`load()` answers the functions by name, each taking an address (an int: a tensor's `data_ptr()`,
0 for NULL) wherever its C declaration takes a pointer: each is cast once, at load, to the same
signature with intptr_t for the pointers (an address travels as a pointer does in the calling
convention), so a call casts nothing and costs what a ctypes call did, or less. Its `ffi` builds
the header's structs: `ffi.new("fused_layer[]", n)`.

Where no compiler is found, or it fails, or cffi is missing, `available()` says why and `load()`
raises NativeUnavailable with that reason; callers fall back to torch or refuse with it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import types
from pathlib import Path
from typing import Any

from attnlens.resources import cache_root

SOURCES = sorted(Path(__file__).parent.glob("*.c"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))  # included by the sources
HEADER = Path(__file__).parent / "attnlens_kernels.h"  # the interface (module docstring)
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-Werror=missing-prototypes"]

_lock = threading.Lock()
_library: Kernels | None = None
_failure: str | None = None


class NativeUnavailable(RuntimeError):
    """The C kernels cannot be built or loaded on this machine (the message says why)."""


class Kernels(types.SimpleNamespace):
    """The library's functions by name (addresses as int where C takes a pointer), `ffi` (its
    structs: ffi.new("fused_layer[]", n)) and `library` (cffi's typed functions)."""


def declarations() -> str:
    """The header as cffi's cdef reads it: plain declarations, its '#' lines (guard, includes) left out."""
    return "".join(line for line in HEADER.read_text().splitlines(keepends=True) if not line.lstrip().startswith("#"))


def _ffi() -> Any:
    """A cffi FFI that has read the header (NativeUnavailable where cffi is not installed)."""
    try:
        import cffi  # attnlens[model]'s; without it the kernels are unavailable, as without a compiler
    except ImportError as e:
        raise NativeUnavailable(f"attnlens' C kernels are called through cffi, not installed here: {e}") from e
    ffi = cffi.FFI()
    ffi.cdef(declarations())
    return ffi


def _by_address(ffi: Any, fn: Any) -> Any:
    """fn cast to its own signature with every pointer parameter an intptr_t."""
    kind = ffi.typeof(fn)
    params = ", ".join("intptr_t" if p.kind == "pointer" else p.cname for p in kind.args)
    return ffi.cast(f"{kind.result.cname}(*)({params})", fn)


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


def load() -> Kernels:
    """The library, built first if needed (NativeUnavailable, with the reason, when it cannot be)."""
    global _library, _failure
    with _lock:
        if _library is not None:
            return _library
        if _failure is not None:
            raise NativeUnavailable(_failure)
        try:
            ffi = _ffi()
            cc = _compiler()
            if cc is None:
                raise NativeUnavailable("attnlens' C kernels need a C compiler to be built once "
                                        "(none found: install gcc, or set CC)")
            path = library_path(cc)
            if not path.is_file():
                _build(cc, path)
            lib = ffi.dlopen(str(path))  # held by `library`: closed when collected
            kernels = Kernels(ffi=ffi, library=lib, **{name: _by_address(ffi, getattr(lib, name)) for name in dir(lib)})
        except NativeUnavailable as e:
            _failure = str(e)
            raise
        except (OSError, subprocess.SubprocessError, AttributeError) as e:
            _failure = f"attnlens' C kernels cannot be built or loaded: {e}"
            raise NativeUnavailable(_failure) from e
        _library = kernels
        return kernels


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
