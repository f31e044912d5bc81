"""The docs show the page's views by their ids (docs/images/page-<view>.png, made by
docs/make_screenshots.py, and `?view=<id>` links): each must still be a view of the page's registry
(static/js/views/registry.js), so renaming or removing a view fails here until the docs follow."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def registry_views() -> set[str]:
    text = (ROOT / "static" / "js" / "views" / "registry.js").read_text()
    block = text.split("export const VIEWS = [", 1)[1].split("\n];", 1)[0]
    return set(re.findall(r'^\s*\{\s*id:\s*"([\w-]+)"', block, flags=re.M))


def docs_views() -> dict[str, set[str]]:
    """{view id: the docs files that show or link it}."""
    found: dict[str, set[str]] = {}
    for path in DOCS:
        text = path.read_text()
        for vid in re.findall(r"images/page-([\w-]+)\.png", text) + re.findall(r"[?&]view=([\w-]+)", text):
            found.setdefault(vid, set()).add(path.name)
    return found


def screenshot_script():
    spec = importlib.util.spec_from_file_location("make_screenshots", ROOT / "docs" / "make_screenshots.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_registry_is_read():
    assert {"head", "model", "atlas", "lens", "ablate"} <= registry_views()


def test_every_view_the_docs_show_is_a_view_of_the_page():
    views, shown = registry_views(), docs_views()
    assert shown, "no view found in the docs"
    gone = {vid: sorted(files) for vid, files in shown.items() if vid not in views}
    assert not gone, f"the docs show views the page no longer has (static/js/views/registry.js): {gone}"


def test_every_screenshot_the_docs_show_is_made_by_the_script_and_committed():
    script = screenshot_script()
    assert set(script.VIEWS) <= registry_views(), "make_screenshots.VIEWS names a view the page lacks"
    for path in DOCS:
        for vid in re.findall(r"images/page-([\w-]+)\.png", path.read_text()):
            assert vid in script.VIEWS, f"{path.name} shows page-{vid}.png, which make_screenshots.py does not make"
            png = ROOT / "docs" / "images" / f"page-{vid}.png"
            assert png.is_file(), f"{png} is missing: run docs/make_screenshots.py"
            data = png.read_bytes()
            assert data[:8] == b"\x89PNG\r\n\x1a\n"
            width = int.from_bytes(data[16:20], "big")
            assert width <= 1600 and len(data) <= 500_000, f"{png.name}: {width} px wide, {len(data)} bytes"
