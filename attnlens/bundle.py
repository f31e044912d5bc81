"""The page's ES modules as one self-contained HTML document, for the notebook views.

A notebook exported to HTML has no server to load /static/js/... from, so the document carries
the modules itself: each module reachable from the entry (static/js/inline.js) becomes a data:
URL under a bare name ("attnlens/views/headview.js"), an import map maps the names to the URLs,
and each module's relative imports ("./matrixview.js", "../attention.js") are rewritten to the
names. The browser then links them exactly as it links the page's files: one copy of the drawing
code, evaluated once per document. The page's CSS goes in a <style>.
"""

from __future__ import annotations

import base64
import functools
import json
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path

from .resources import static_dir

ENTRY = "inline.js"  # static/js/inline.js
NAME_PREFIX = "attnlens/"
# the module specifier of a static import / export-from / side-effect import / dynamic import("…")
SPECIFIER = re.compile(r"""((?:\bfrom|\bimport)\s*\(?\s*)(["'])(\.{1,2}/[^"'\n]+)\2""")


class BundleError(RuntimeError):
    """The page's modules cannot be bundled (a file is missing or an import does not resolve)."""


@dataclass(frozen=True)
class Bundle:
    import_map: dict  # {"imports": {name: data URL}}
    css: str
    entry: str  # the entry module's name

    @property
    def modules(self) -> list[str]:
        return list(self.import_map["imports"])


def _name(relative: str) -> str:
    return NAME_PREFIX + relative


def _data_url(source: str) -> str:
    return "data:text/javascript;base64," + base64.b64encode(source.encode("utf-8")).decode("ascii")


def module_graph(js_dir: Path, entry: str = ENTRY) -> dict[str, str]:
    """Every module reachable from `entry` (paths relative to js_dir) -> its source with its
    relative imports rewritten to bare names."""
    out: dict[str, str] = {}
    todo = [entry]
    while todo:
        rel = todo.pop()
        if rel in out:
            continue
        path = js_dir / rel
        if not path.is_file():
            raise BundleError(f"the page's module {rel} is missing from {js_dir}")
        here = posixpath.dirname(rel)

        def rewrite(m: re.Match) -> str:
            target = posixpath.normpath(posixpath.join(here, m.group(3)))
            if target.startswith("../"):
                raise BundleError(f"{rel} imports {m.group(3)}, outside {js_dir}")
            todo.append(target)
            return f"{m.group(1)}{m.group(2)}{_name(target)}{m.group(2)}"

        out[rel] = SPECIFIER.sub(rewrite, path.read_text(encoding="utf-8"))
    return out


def _fingerprint(root: Path) -> tuple:
    files = sorted(root.rglob("*.js")) + sorted(root.rglob("*.css"))
    return tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in files)


@functools.lru_cache(maxsize=4)
def _bundle(root: str, fingerprint: tuple) -> Bundle:
    root_path = Path(root)
    modules = module_graph(root_path / "js")
    css_path = root_path / "css" / "style.css"
    css = css_path.read_text(encoding="utf-8") if css_path.is_file() else ""
    import_map = {"imports": {_name(rel): _data_url(src) for rel, src in sorted(modules.items())}}
    return Bundle(import_map, css, _name(ENTRY))


def bundle(root: Path | None = None) -> Bundle:
    """The inline views' modules and CSS from the page's files (`root`: static/, found by default);
    rebuilt only when a file changes."""
    root = Path(root) if root is not None else static_dir()
    if not (root / "js" / ENTRY).is_file():
        raise BundleError(f"the page's files are not at {root} (no js/{ENTRY}): reinstall attnlens")
    return _bundle(str(root), _fingerprint(root))


def script_json(value) -> str:
    """JSON safe inside a <script> element (no "</" or "<!--" can end or confuse it)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")


def document(spec: dict, *, title: str = "attnlens", root: Path | None = None) -> str:
    """A standalone HTML document that draws `spec` (inline.js's mountInline) with nothing
    outside it: open it from a file, embed it in an iframe's srcdoc, with the network off."""
    b = bundle(root)
    html_title = title.replace("&", "&amp;").replace("<", "&lt;")
    return (
        "<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        "<meta name=\"color-scheme\" content=\"light dark\">\n"
        f"<title>{html_title}</title>\n<style>\n{b.css}\n</style>\n"
        f"<script type=\"importmap\">{script_json(b.import_map)}</script>\n"
        "</head>\n<body>\n<div id=\"attnlens-root\"></div>\n<div id=\"tooltip\" role=\"tooltip\" hidden></div>\n"
        f"<script type=\"application/json\" id=\"attnlens-spec\">{script_json(spec)}</script>\n"
        f"<script type=\"module\">import {{ mountInline }} from \"{b.entry}\";\n"
        "mountInline(document.getElementById(\"attnlens-root\"), "
        "JSON.parse(document.getElementById(\"attnlens-spec\").textContent));</script>\n"
        "</body>\n</html>\n"
    )
