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
    (tests/test_import_graph.py), TYPE_CHECKING blocks included: a circle there is a circle of
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
