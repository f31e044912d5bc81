"""The engine's layout (app/engine/__init__.py): a front, one client interface with two
transports, and one core. Its modules import one another without a circle, the core knows
nothing of the front or of requests' output state, and there is one scheduler class: the
engine process runs the very EngineCore that runs on a thread here."""

from __future__ import annotations

import ast
from pathlib import Path

import attnlens.app.engine as engine_package

ENGINE = Path(engine_package.__file__).parent
APP = ENGINE.parent


def _module_of(path: Path) -> str:
    rel = path.relative_to(APP.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["attnlens", *parts])  # app/engine/core.py -> attnlens.app.engine.core


def _imports(path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that `path` imports (TYPE_CHECKING blocks included: a circle there
    is a circle of meaning too); relative imports resolved, `from . import x` as module x."""
    module = _module_of(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name in known and name != module:
                found.add(name)
    return found


def engine_import_graph() -> dict[str, set[str]]:
    """module -> the modules of app/engine and of app's top level (memory.py, loader.py, ...) it
    imports, for each of those modules (the packages' __init__ and __main__ left out)."""
    files = [f for f in sorted(ENGINE.glob("*.py")) + sorted(APP.glob("*.py"))
             if f.name not in ("__init__.py", "__main__.py")]
    known = {_module_of(f) for f in files}
    return {_module_of(f): _imports(f, known) for f in files}


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The modules that import one another in a circle: each strongly connected set of more than
    one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_engine_modules_import_one_another_without_a_circle():
    graph = engine_import_graph()
    assert "attnlens.app.engine.core" in graph and graph["attnlens.app.engine.front"]
    engine_circles = [sorted(c) for c in circles(graph) if any(m.startswith("attnlens.app.engine.") for m in c)]
    assert engine_circles == []


def test_the_circle_finder_finds_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_core_knows_neither_the_front_nor_output_state():
    graph = engine_import_graph()
    e = "attnlens.app.engine."
    assert not graph[e + "core"] & {e + "front", e + "outputs", e + "client", e + "process", e + "stream_budget"}
    assert e + "front" not in graph[e + "outputs"]
    assert e + "outputs" not in graph[e + "stream_budget"]
    # the front reaches the core only through its client
    assert e + "core" not in graph[e + "front"] and e + "client" in graph[e + "front"]


def test_one_scheduler_the_core_subclassed_nowhere():
    from attnlens.app.engine import EngineCore, EngineFront

    for cls in (EngineCore, EngineFront):
        assert not cls.__subclasses__(), cls.__subclasses__()
    worker = (ENGINE / "worker.py").read_text()
    assert "EngineCore(" in worker  # the engine process runs the same core
