"""No import circles: the modules of model/ (attnlens.model) and of the client package (attnlens)
import each other in one direction only, read from the source with `ast` (nothing is imported).

Every import counts, wherever it stands: at the top of a module, inside a function (a lazy import
still ties the two modules together; hiding a circle in a function does not break it), under
try/except. Imports under `if TYPE_CHECKING:` do not count: they run only in the type checker,
which follows circles without harm, and they are how a module names a type it must not import.

An edge A -> B means module A imports module B: `from .x import y` names the module x (or the
module x.y when that is a module itself); `import attnlens.model.x` names it; importing a
package also runs its __init__, so `from ..families import build_model` is an edge to
attnlens.model.families."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import REPO_ROOT

# the package's folders, by the import name they have (attnlens/app and attnlens/model link to them)
FOLDERS = {"attnlens": REPO_ROOT / "attnlens", "attnlens.app": REPO_ROOT / "app", "attnlens.model": REPO_ROOT / "model"}


def module_files() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its __init__.py)."""
    found = {}
    for prefix, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if prefix == "attnlens" and parts[0] in ("app", "model", "static"):
                continue  # the links: their own entries in FOLDERS
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((prefix, *parts))] = path
    return found


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def runtime_imports(tree: ast.AST, type_checking: bool = False):
    """The Import / ImportFrom nodes of a module, skipping the bodies of `if TYPE_CHECKING:` unless
    `type_checking` (a circle there is a circle of meaning, if not of loading)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if not type_checking and isinstance(node, ast.If) and is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imported_modules(name: str, path: Path, modules: dict[str, Path], type_checking: bool = False) -> set[str]:
    """The package's modules that module `name` imports (outside TYPE_CHECKING, unless `type_checking`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    own_packages = {".".join(package.split(".")[:i]) for i in range(1, package.count(".") + 2)}
    out = set()
    for node in runtime_imports(ast.parse(path.read_text(encoding="utf-8"), str(path)), type_checking):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base = package.split(".")
                source = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from p import x`: the module p.x when x is one, else the name x from p
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                       for alias in node.names]
        for target in targets:
            while target and target not in modules:  # a name inside a module: that module
                target = target.rpartition(".")[0]
            # the module and the packages above it that it runs first (the importer's own
            # packages are running already: a submodule does not depend on its package's __init__
            # unless it takes a name from it, `from . import name`, which is an edge to it)
            parts = target.split(".")
            chain = [target] + [".".join(parts[:i]) for i in range(1, len(parts))
                                if ".".join(parts[:i]) not in own_packages]
            out.update(t for t in chain if t in modules and t != name)
    return out


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported_modules(name, path, modules, type_checking) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]], within: str) -> list[list[str]]:
    """The strongly connected components (Tarjan) of more than one module, or of one module that
    imports itself, among the modules under `within`; each sorted, as a list."""
    nodes = {n for n in graph if n == within or n.startswith(within + ".")}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v] & nodes:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return sorted(found)


def describe(found: list[list[str]]) -> str:
    return "\n".join(f"{len(c)} modules: " + ", ".join(c) for c in found)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_graph_reads_every_kind_of_import(graph):
    """A sanity check on the reader: relative, absolute and in-function imports are edges."""
    assert "attnlens.model.config" in graph["attnlens.model.checkpoint"]  # from .config import ...
    assert "attnlens.model" in graph["attnlens.model.placement"] or any(
        n.startswith("attnlens.model.") for n in graph["attnlens.model.placement"])  # from attnlens.model... import
    assert any(n.startswith("attnlens.model.training") for n in graph["attnlens.app.cli.commands"])  # inside a function


def test_model_has_no_import_cycle(graph):
    found = cycles(graph, "attnlens.model")
    assert not found, "import cycles in model/:\n" + describe(found)


def test_the_client_package_has_no_import_cycle(graph):
    """attnlens itself (its own modules, not app/ and model/ below it)."""
    own = {n: deps for n, deps in graph.items() if not n.startswith(("attnlens.app", "attnlens.model"))}
    found = cycles(own, "attnlens")
    assert not found, "import cycles in attnlens/:\n" + describe(found)


def test_app_has_no_import_cycle(graph):
    found = cycles(graph, "attnlens.app")
    assert not found, "import cycles in app/:\n" + describe(found)


def test_the_engine_knows_nothing_of_the_service_around_it(graph):
    """The engine (app/engine/) schedules and runs model calls: it imports model/ and itself, never the
    API, the serving objects, the server or the registry that composes it (issue 31)."""
    around = ("attnlens.app.api", "attnlens.app.serving", "attnlens.app.server", "attnlens.app.registry",
              "attnlens.app.cli")
    wrong = sorted(f"{n} -> {d}" for n, deps in graph.items() if n.startswith("attnlens.app.engine")
                   for d in deps if d.startswith(around))
    assert not wrong, "the engine imports the service around it:\n" + "\n".join(wrong)


def test_model_imports_nothing_of_the_app(graph):
    wrong = sorted(f"{n} -> {d}" for n, deps in graph.items() if n.startswith("attnlens.model")
                   for d in deps if d.startswith("attnlens.app"))
    assert not wrong, "model/ imports app/:\n" + "\n".join(wrong)


if __name__ == "__main__":  # print the cycles: python tests/engine/test_import_graph.py
    g = import_graph()
    for within in ("attnlens.model", "attnlens.app"):
        print(within, "\n" + (describe(cycles(g, within)) or "none"))


def test_no_import_circle_anywhere_even_through_type_checking_imports():
    """A circle drawn only by annotations (a TYPE_CHECKING import one way, a real one back) is a
    circle of meaning all the same: the house has none (answers.py <-> bertviz.py was the last)."""
    typed = import_graph(type_checking=True)
    for within in ("attnlens.model", "attnlens.app"):
        assert cycles(typed, within) == [], describe(cycles(typed, within))
    client = {n: deps for n, deps in typed.items() if not n.startswith(("attnlens.model", "attnlens.app"))}
    assert cycles(client, "attnlens") == [], describe(cycles(client, "attnlens"))
