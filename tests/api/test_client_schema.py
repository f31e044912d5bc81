"""The client's answer types (attnlens/answers.py, parsed by hand so a base install needs no
pydantic) read only fields the server's OpenAPI schema declares: each `from_json` is read with
`ast` for the keys it takes from its answer (d["x"], d.get("x")), and every key must be a property
of the response schema it parses. A renamed or dropped server field fails here, not in a user's
notebook."""

from __future__ import annotations

import ast
import inspect

import pytest

import attnlens.answers as answers
from attnlens.app.server.main import create_app
from attnlens.app.server.settings import Settings

# client class -> the OpenAPI component its from_json reads
SCHEMA_OF = {
    "Token": "TokenText",
    "GroupSpec": "AttentionGroupInfo",
    "Attention": "AttentionResponse",
    "GeneratedToken": ("GeneratedTokenOut", "StreamToken"),  # a /generate answer's tokens, and streamed ones
    "Generation": "GenerateResponse",
    "StreamDone": "StreamDone",
    "ModelSummary": "ModelSummary",
    "FillMask": "FillMaskResponse",
    "Classification": "ClassifyResponse",
    "Embeddings": "EmbeddingList",
    "HeadGroupScores": "HeadGroup",
    "HeadAtlas": "HeadsResponse",
    "TokenProb": "TokenProb",
    "PositionLogits": "PositionLogits",
    "LogitsAnswer": "LogitsResponse",
    "LensAnswer": "LensResponse",
    "HeadExplanation": "ExplainResponse",
    "ScorePair": "ScorePair",
    "ScoreParts": "ScoreParts",
    "PatchAnswer": "PatchResponse",
    "LogitAttributionAnswer": "LogitAttributionResponse",
}


@pytest.fixture(scope="module")
def components() -> dict[str, dict]:
    return create_app(Settings(warmup=False)).openapi()["components"]["schemas"]


def keys_read(cls) -> set[str]:
    """The string keys from_json reads from its first argument (subscripts and .get calls); for one
    that takes the keys named as its fields, the fields it cannot do without."""
    import dataclasses

    if "__dataclass_fields__" in inspect.getsource(cls.from_json):
        return {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    fn = ast.parse(inspect.getsource(cls.from_json.__func__).lstrip().replace("\n    ", "\n")).body[0]
    assert isinstance(fn, ast.FunctionDef)
    data = fn.args.args[1].arg  # after cls
    keys = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == data \
                and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
            keys.add(node.slice.value)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == data and node.args \
                and isinstance(node.args[0], ast.Constant):
            keys.add(node.args[0].value)
    return keys


def properties(schema: dict, components: dict) -> set[str]:
    """A component's properties, through allOf / anyOf / $ref."""
    if "$ref" in schema:
        return properties(components[schema["$ref"].rsplit("/", 1)[1]], components)
    found = set(schema.get("properties", {}))
    for part in schema.get("allOf", []) + schema.get("anyOf", []):
        found |= properties(part, components)
    return found


def test_every_answer_type_is_mapped():
    parsed = {name for name, cls in vars(answers).items()
              if inspect.isclass(cls) and cls.__module__ == answers.__name__ and "from_json" in vars(cls)}
    assert parsed - {"LogitsEffect"} == set(SCHEMA_OF)  # LogitsEffect reads a list of PositionEffect rows


@pytest.mark.parametrize("name", sorted(SCHEMA_OF))
def test_an_answer_reads_only_what_its_schema_declares(name, components):
    schemas = SCHEMA_OF[name] if isinstance(SCHEMA_OF[name], tuple) else (SCHEMA_OF[name],)
    for schema in schemas:
        assert schema in components, f"the server has no {schema} schema any more"
    read = keys_read(getattr(answers, name))
    assert read, f"{name}.from_json reads no key: the test would prove nothing"
    declared = set().union(*(properties(components[s], components) for s in schemas))
    unknown = read - declared
    assert not unknown, f"{name} reads {sorted(unknown)}, which {' or '.join(schemas)} does not declare"
