"""The model a route serves comes from one dependency per task (app/api/deps.py): every route that
takes a model gives the same 503 until start-up is done, a body is validated before its model is
looked up, and the handlers take their dependencies through the `Annotated` aliases."""

from __future__ import annotations

import ast
import importlib

import pytest
from conftest import REPO_ROOT
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from attnlens.app.api import deps
from attnlens.app.server.main import create_app
from attnlens.app.server.settings import Settings

TEXT = {"text": "To be, or not to be"}
# (method, path) -> a valid request for each route that takes a model
MODEL_ROUTES: dict[tuple[str, str], dict] = {
    ("POST", "/generate"): {"json": {"prompt": "To be"}},
    ("POST", "/attention"): {"json": TEXT},
    ("POST", "/heads"): {"json": TEXT},
    ("POST", "/logits"): {"json": TEXT},
    ("POST", "/lens"): {"json": TEXT},
    ("POST", "/attention/explain"): {"json": {**TEXT, "layer": 0, "head": 0, "query": 1}},
    ("POST", "/patch"): {"json": {"clean": "To be", "corrupted": "To go", "answer_id": 1, "foil_id": 2}},
    ("POST", "/logit-attribution"): {"json": TEXT},
    ("POST", "/fill-mask"): {"json": {"text": "To be, or not to [MASK]"}},
    ("POST", "/classify"): {"json": TEXT},
    ("POST", "/v1/completions"): {"json": {"prompt": "To be"}},
    ("POST", "/v1/chat/completions"): {"json": {"messages": [{"role": "user", "content": "To be?"}]}},
    ("POST", "/v1/embeddings"): {"json": {"input": "To be"}},
    ("GET", "/model"): {"params": {"model": "tiny"}},
    ("GET", "/models"): {},
    ("GET", "/v1/models"): {},
    ("GET", "/v1/models/{model}"): {},
}
MODEL_DEPENDENCIES = (deps.get_registry, deps.any_model, deps.listed_model)
ROUTE_FILES = sorted((REPO_ROOT / "app" / "api").glob("*_routes.py"))


def api_routes() -> list[APIRoute]:
    """Every route of app/api's routers, as the app includes them."""
    return [r for path in ROUTE_FILES for r in importlib.import_module(f"attnlens.app.api.{path.stem}").router.routes
            if isinstance(r, APIRoute)]


def takes_a_model(dependant) -> bool:
    """Whether a route's dependencies reach the registry or a model (as a model dependency does)."""
    return any(isinstance(d.call, deps.BodyModel) or d.call in MODEL_DEPENDENCIES or takes_a_model(d)
               for d in dependant.dependencies)


@pytest.fixture(scope="module")
def starting(tiny_checkpoint):
    """The app before its start-up has run (no `with`: nothing is loaded, every model is not ready)."""
    app = create_app(Settings(model=tiny_checkpoint, device="cpu"))
    return app, TestClient(app)


def test_the_routes_listed_here_are_every_route_that_takes_a_model():
    found = {(method, r.path) for r in api_routes() if takes_a_model(r.dependant) for method in r.methods}
    assert found == set(MODEL_ROUTES)


def test_every_route_that_takes_a_model_gives_the_same_503_until_ready(starting):
    _, client = starting
    native, openai = [], []
    for (method, path), kwargs in MODEL_ROUTES.items():
        r = client.request(method, path.replace("{model}", "tiny"), **kwargs)
        assert r.status_code == 503, (path, r.text)
        assert r.headers["Retry-After"] == "5", path
        (openai if path.startswith("/v1/") else native).append(r.json())
    assert all(body == native[0] for body in native), native
    assert all(body == openai[0] for body in openai), openai
    assert native[0] == {"detail": "the models are not ready (starting)", "code": "not_ready"}
    assert openai[0] == {"error": {"message": "the models are not ready (starting)", "type": "server_error",
                                   "param": None, "code": "not_ready"}}


def test_a_body_is_validated_before_its_model_is_looked_up(starting):
    """Not ready yet, a request that is not valid is still the 422 that says why (each error once)."""
    _, client = starting
    for path in ("/generate", "/fill-mask", "/v1/completions"):
        r = client.post(path, json={"model": "tiny", "nonsense": 1})
        assert r.status_code == 422, (path, r.text)
        errors = r.json()["detail"] if not path.startswith("/v1/") else None
        if errors is not None:
            assert len(errors) == len({str(e) for e in errors}), errors


def handlers() -> dict[str, ast.AsyncFunctionDef | ast.FunctionDef]:
    """Every route handler in app/api by module:name: a function decorated with `router.<method>(...)`."""
    found = {}
    for path in ROUTE_FILES:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                    isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)
                    and isinstance(d.func.value, ast.Name) and d.func.value.id == "router"
                    for d in node.decorator_list):
                found[f"attnlens.app.api.{path.stem}:{node.name}"] = node
    return found


def test_no_handler_declares_a_dependency_of_its_own():
    """Handlers take the state, the settings, the registry and their model through deps.py's
    aliases: no `Depends(...)` in a signature, and no `get_state` at all."""
    found = handlers()
    assert set(found) == {f"{r.endpoint.__module__}:{r.endpoint.__name__}" for r in api_routes()}  # each read
    wrong = []
    for name, fn in found.items():
        args = fn.args
        for part in [*args.defaults, *args.kw_defaults, *(a.annotation for a in args.args + args.kwonlyargs)]:
            if part is None:
                continue
            if any(isinstance(node, ast.Name) and node.id in ("Depends", "get_state") for node in ast.walk(part)):
                wrong.append(f"{name}: {ast.unparse(part)}")
    assert not wrong, "handlers declaring their own dependencies:\n" + "\n".join(wrong)
