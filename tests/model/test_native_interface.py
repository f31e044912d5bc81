"""The C kernels' interface is declared once (model/native/attnlens_kernels.h) and everything agrees with it.

The header's prototypes against the sources' definitions (name, return type, parameter types in
order), read here by a small parser of our own, not by the compiler; a wrong copy of a source is
caught by it and by the compiler. Then the built library: every declared function is in it, the
struct's layout as cffi computes it is the compiler's, and a call lets other Python threads run.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from attnlens.model.native import library as native

NATIVE = Path(native.__file__).parent

needs_compiler = pytest.mark.skipif(native._compiler() is None, reason="no C compiler here")


def _code(text: str) -> str:
    """C text without comments and preprocessor lines (continuations joined first)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text).replace("\\\n", " ")
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def _type(text: str) -> str:
    """A C type written one way: single spaces, '*' after a space ("const float *")."""
    return re.sub(r"\s*\*\s*", " *", re.sub(r"\s+", " ", text)).strip()


def _signature(head: str) -> tuple[str, tuple[str, str, tuple[str, ...]]] | None:
    """'int f(const float *x, int64_t n)' -> ("f", ("int", ("const float *", "int64_t"))), or None."""
    m = re.fullmatch(r"\s*(?P<ret>[\w\s*]+?)\s*\b(?P<name>\w+)\s*\((?P<params>[^()]*)\)\s*", head)
    if m is None:
        return None
    params = [p for p in (_type(p) for p in m["params"].split(",")) if p and p != "void"]
    types = []
    for p in params:
        typed = re.fullmatch(r"(.*?[\s*])(\w+)", p)
        assert typed is not None, f"a parameter without a name: {p!r} in {head.strip()!r}"
        types.append(_type(typed[1]))
    return m["name"], (_type(m["ret"]), tuple(types))


def top_level(text: str) -> list[tuple[str, str]]:
    """The file's top-level statements, each as (its text up to '{' or ';', that character)."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "{":
            if depth == 0:
                out.append((text[start:i], "{"))
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                start = i + 1
        elif ch == ";" and depth == 0:
            out.append((text[start:i], ";"))
            start = i + 1
    return out


def declarations(header: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    """The header's function prototypes by name."""
    found = {}
    for head, end in top_level(_code(header)):
        sig = _signature(head) if end == ";" else None
        if sig is not None:
            assert sig[0] not in found, f"{sig[0]} is declared twice"
            found[sig[0]] = sig[1]
    return found


def definitions(source: str) -> list[tuple[str, tuple[str, tuple[str, ...]]]]:
    """The source's exported (not static) function definitions, as (name, signature)."""
    found = []
    for head, end in top_level(_code(source)):
        if end == "{" and not re.match(r"\s*static\b", head):
            sig = _signature(head)
            if sig is not None:
                found.append(sig)
    return found


def disagreements(folder: Path) -> list[str]:
    """Where folder's *.c definitions and its header's declarations differ (empty: they agree)."""
    declared = declarations((folder / native.HEADER.name).read_text())
    problems, defined = [], set()
    for source in sorted(folder.glob("*.c")):
        for name, sig in definitions(source.read_text()):
            defined.add(name)
            if name not in declared:
                problems.append(f"{source.name}: {name} is exported but not declared in the header")
            elif sig != declared[name]:
                problems.append(f"{source.name}: {name} is defined as {sig}, declared as {declared[name]}")
    problems += [f"{name} is declared but defined in no source" for name in sorted(set(declared) - defined)]
    return problems


def test_the_header_declares_what_the_sources_define():
    declared = declarations(native.HEADER.read_text())
    assert declared["swiglu"] == ("void", ("const float *", "int64_t", "int64_t", "float *"))
    assert disagreements(NATIVE) == []


def test_every_source_includes_the_header():
    for source in sorted(NATIVE.glob("*.c")):
        assert f'#include "{native.HEADER.name}"' in source.read_text(), source.name


WRONG = {  # a file changed so that a source and the header disagree: (file, old, new, the problem reported)
    "a parameter's type": ("swiglu.c", "int64_t rows,", "int rows,", "swiglu.c: swiglu is defined as"),
    "the return type": ("vocab_stats.c", "int64_t vocab_stats(", "int vocab_stats(",
                        "vocab_stats.c: vocab_stats is defined as"),
    "the parameters' order": ("rms_norm.c", "const float *w, float eps,", "float eps, const float *w,",
                              "rms_norm.c: rms_norm is defined as"),
    "an export the header lacks": ("swiglu.c", "void swiglu(", "void swiglu_rows(void) {}\nvoid swiglu(",
                                   "swiglu.c: swiglu_rows is exported but not declared"),
    "a declaration no source defines": (native.HEADER.name, "void swiglu(", "void swiglu_rows(void);\nvoid swiglu(",
                                        "swiglu_rows is declared but defined in no source"),
}


@pytest.mark.parametrize("change", sorted(WRONG))
def test_a_source_that_disagrees_with_the_header_is_caught(tmp_path, change):
    """The parser reports a wrong copy, and the compiler refuses a wrong source (where there is one)."""
    for path in list(NATIVE.glob("*.c")) + list(NATIVE.glob("*.h")):
        shutil.copy(path, tmp_path / path.name)
    name, old, new, problem = WRONG[change]
    text = (tmp_path / name).read_text()
    assert text.count(old) == 1
    (tmp_path / name).write_text(text.replace(old, new))
    problems = disagreements(tmp_path)
    assert len(problems) == 1 and problems[0].startswith(problem), problems
    cc = native._compiler()
    if cc is not None and name.endswith(".c"):
        check = [cc, "-fsyntax-only", "-Werror=missing-prototypes", "-march=native", "-fopenmp"]
        assert subprocess.run([*check, str(NATIVE / name)], capture_output=True).returncode == 0
        assert subprocess.run([*check, str(tmp_path / name)], capture_output=True).returncode != 0


@needs_compiler
def test_every_declared_function_is_in_the_built_library():
    ok, why = native.available()
    assert ok, why  # a compiler is here: the kernels must build (the other kernel tests would only skip)
    kernels = native.load()
    declared = declarations(native.HEADER.read_text())
    assert sorted(set(vars(kernels)) - {"ffi", "library"}) == sorted(declared)
    for name in declared:
        assert getattr(kernels.library, name) is not None  # a symbol the library lacks raises AttributeError
        kind = kernels.ffi.typeof(getattr(kernels, name))
        assert len(kind.args) == len(declared[name][1])


@needs_compiler
def test_the_struct_layout_cffi_computes_is_the_compilers(tmp_path):
    ffi = native.load().ffi
    structs = ("fused_linear", "fused_layer", "attention_reduction")
    fields = {struct: [name for name, _ in ffi.typeof(struct).fields] for struct in structs}
    lines = [f'printf("%zu\\n", sizeof({s}));' + "".join(f'printf("%zu\\n", offsetof({s}, {f}));' for f in names)
             for s, names in fields.items()]
    program = tmp_path / "layout.c"
    program.write_text(f'#include <stddef.h>\n#include <stdio.h>\n#include "{native.HEADER}"\n'
                       f'int main(void) {{ {"".join(lines)} return 0; }}\n')
    subprocess.run([native._compiler(), "-o", str(tmp_path / "layout"), str(program)], check=True)
    printed = [int(n) for n in subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True,
                                              check=True).stdout.split()]
    cffis = [n for s, names in fields.items() for n in [ffi.sizeof(s)] + [ffi.offsetof(s, f) for f in names]]
    assert printed == cffis


@needs_compiler
def test_a_kernel_call_lets_other_python_threads_run():
    """cffi releases the GIL for a call, as ctypes did: a thread stamps the time while one long
    causal_attention runs, and some stamps fall well inside the call."""
    lib = native.load()
    H, T, D = 4, 4096, 64
    q, k, v = (torch.randn(H, T, D) for _ in range(3))
    out = torch.empty(T, H, D)
    stamps: list[float] = []
    stop = threading.Event()

    def stamp():
        while not stop.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0.0005)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the kernel on one core, the stamping thread free to take the other
    thread = threading.Thread(target=stamp)
    thread.start()
    try:
        time.sleep(0.01)
        t0 = time.perf_counter()
        failed = lib.causal_attention(q.data_ptr(), T * D, D, k.data_ptr(), T * D, D, v.data_ptr(), T * D, D,
                                      H, H, T, T, D, D ** -0.5, out.data_ptr())
        t1 = time.perf_counter()
    finally:
        stop.set()
        thread.join()
        torch.set_num_threads(threads)
    assert failed == 0 and t1 - t0 > 0.03, (failed, t1 - t0)  # long against the interpreter's 5 ms switch
    quarter = (t1 - t0) / 4
    assert any(t0 + quarter < s < t1 - quarter for s in stamps)
