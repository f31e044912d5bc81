"""Write the OpenAPI reference from the live schema: docs/openapi.json (create_app().openapi(),
the same document the server gives at /openapi.json) and docs/openapi.md (a page listing every
route, linking the JSON). tests/api/test_docs_openapi.py fails when either is stale.

    PYTHONPATH=. .venv/bin/python docs/make_openapi.py          # rewrite both
    PYTHONPATH=. .venv/bin/python docs/make_openapi.py --check  # exit 1 if they differ
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent


def schema() -> dict:
    """The service's OpenAPI document with every setting at its default (no ATTNLENS_* variable)."""
    for key in [k for k in os.environ if k.startswith("ATTNLENS_")]:
        del os.environ[key]
    from attnlens.app.server.main import create_app

    return create_app().openapi()


def render(doc: dict) -> tuple[str, str]:
    """(openapi.json's text, openapi.md's text) for a schema."""
    text = json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
    info = doc.get("info", {})
    rows = []
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            summary = (op.get("summary") or "").replace("|", "\\|")
            first = (op.get("description") or "").strip().split("\n\n")[0].replace("\n", " ").replace("|", "\\|")
            rows.append(f"| `{method.upper()} {path}` | {summary} | {first} |")
    page = "\n".join([
        "# OpenAPI reference",
        "",
        "<!-- written by docs/make_openapi.py from create_app().openapi(); do not edit by hand -->",
        "",
        f"The service's OpenAPI {doc.get('openapi', '')} document, {info.get('title', '')} {info.get('version', '')},",
        "as the server itself gives it at `/openapi.json`: **[openapi.json](openapi.json)** (every route,",
        "request and answer schema). A running server also renders it at `/docs` (Swagger UI) and",
        "`/redoc`, with their scripts served by the server itself (no CDN). The [HTTP API guide](api.md)",
        "explains the same routes by task.",
        "",
        "| route | summary | what it does |",
        "| --- | --- | --- |",
        *rows,
        "",
    ])
    return text, page


def main(argv: list[str]) -> int:
    text, page = render(schema())
    targets = {DOCS / "openapi.json": text, DOCS / "openapi.md": page}
    if "--check" in argv:
        stale = [p.name for p, t in targets.items() if not p.is_file() or p.read_text() != t]
        if stale:
            print(f"stale: {', '.join(stale)}; run: PYTHONPATH=. python docs/make_openapi.py", file=sys.stderr)
            return 1
        return 0
    for path, t in targets.items():
        path.write_text(t)
        print(f"wrote {path} ({len(t):,} characters)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
