"""The engine's layout (app/engine/__init__.py): a front, one client interface with two
transports, and one core. Its modules import one another without a circle, the core knows
nothing of the front or of requests' output state, and there is one scheduler class: the
engine process runs the very EngineCore that runs on a thread here."""

from __future__ import annotations

from pathlib import Path

from test_import_graph import cycles, import_graph

import attnlens.app.engine as engine_package

ENGINE = Path(engine_package.__file__).parent


def engine_import_graph() -> dict[str, set[str]]:
    """module -> the modules it imports, every module of the package read with `ast`
    (tests/engine/test_import_graph.py), TYPE_CHECKING blocks included: a circle there is a circle of
    meaning too."""
    return import_graph(type_checking=True)


def test_the_engine_modules_import_one_another_without_a_circle():
    graph = engine_import_graph()
    assert "attnlens.app.engine.core" in graph and graph["attnlens.app.engine.front"]
    engine_circles = [c for c in cycles(graph, "attnlens.app") if any(m.startswith("attnlens.app.engine.") for m in c)]
    assert engine_circles == []


def test_the_circle_finder_finds_one():
    assert cycles({"x.a": {"x.b"}, "x.b": {"x.c"}, "x.c": {"x.a"}, "x.d": {"x.a"}}, "x") == [["x.a", "x.b", "x.c"]]
    assert cycles({"x.a": {"x.b"}, "x.b": set()}, "x") == []


def test_the_core_knows_neither_the_front_nor_output_state():
    graph = engine_import_graph()
    e = "attnlens.app.engine."
    assert not graph[e + "core"] & {e + "front", e + "outputs", e + "client", e + "process"}
    assert e + "front" not in graph[e + "outputs"]
    # the front reaches the core only through its client
    assert e + "core" not in graph[e + "front"] and e + "client" in graph[e + "front"]


def test_one_scheduler_the_core_subclassed_nowhere():
    from attnlens.app.engine import EngineCore, EngineFront

    for cls in (EngineCore, EngineFront):
        assert not cls.__subclasses__(), cls.__subclasses__()
    worker = (ENGINE / "worker.py").read_text()
    assert "EngineCore(" in worker  # the engine process runs the same core


def _engine_uses(path: Path) -> tuple[set[str], set[str]]:
    """The attributes of `engine` / `self.engine` that a module assigns, and those it reads."""
    import ast

    written, read = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            base = node.value
            is_engine = (isinstance(base, ast.Name) and base.id == "engine") or (
                isinstance(base, ast.Attribute) and base.attr == "engine")
            if is_engine:
                (written if isinstance(node.ctx, ast.Store) else read).add(node.attr)
    return written, read


def test_the_supervisor_acts_only_through_the_fronts_methods():
    """It sets no field of the front and reaches into none of its parts (admission, client)."""
    written, read = _engine_uses(ENGINE / "supervisor.py")
    assert written == set()
    assert not read & {"admission", "client", "_state", "_supervised"}


def test_the_front_is_the_one_place_an_engines_state_is_derived():
    from attnlens.app.engine import EngineFront

    assert isinstance(EngineFront.__dict__["state"], property)  # derived, never assigned from outside
    source = (ENGINE / "supervisor.py").read_text()
    assert '"running" if' not in source and "return self.engine.state" in source
