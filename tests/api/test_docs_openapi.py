"""The docs' OpenAPI reference (docs/openapi.json, docs/openapi.md) is the server's live schema:
create_app().openapi() with default settings, written by docs/make_openapi.py. A route or field
changed without running the script fails here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_openapi_reference_is_the_live_schema():
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNLENS_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "docs/make_openapi.py", "--check"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr


def test_the_reference_page_lists_every_route_and_links_the_json():
    doc = json.loads((ROOT / "docs" / "openapi.json").read_text())
    page = (ROOT / "docs" / "openapi.md").read_text()
    assert "](openapi.json)" in page
    for path, ops in doc["paths"].items():
        for method in ops:
            assert f"`{method.upper()} {path}`" in page
