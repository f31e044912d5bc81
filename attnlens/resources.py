"""Where attnlens' files are, in a repository checkout (or its editable install) and in a wheel.

    checkout / editable install          installed wheel
    <repo>/attnlens/  (this package)     site-packages/attnlens/
    <repo>/static/    (the page)         site-packages/attnlens/static/   (package data, pyproject.toml)
    <repo>/checkpoints/                  none: checkpoints/ in the working directory, or give a path

The server (`attnlens serve`: its page) and the notebook views (attnlens.show: the page's ES
modules and CSS) both ask here, so neither depends on where it was installed from.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def source_root() -> Path | None:
    """The repository checkout this package runs from, or None for an installed wheel.

    A checkout has the package folder beside pyproject.toml and the app/, model/ and static/
    folders that the package links to (attnlens/app -> ../app, ...); a wheel's parent is
    site-packages."""
    root = PACKAGE_DIR.parent
    markers = ("pyproject.toml", "app/server/settings.py", "model/__init__.py", "static/index.html")
    return root if all((root / m).is_file() for m in markers) else None


def static_dir() -> Path:
    """The page's files (index.html, css/, js/): the checkout's static/ (which the package's
    static link points to), else the wheel's package data. (When the page is missing, the
    wheel's path: the server answers / with a 404 that names it, and the notebook views say what
    is missing.)"""
    root = source_root()
    return root / "static" if root is not None else PACKAGE_DIR / "static"


def checkout_path(*parts: str) -> Path:
    """A folder the repository has beside the package (checkpoints/, data/): the checkout's; a
    wheel ships none, so there it is the same path in the working directory (relative, resolved
    when used)."""
    root = source_root()
    return Path(root, *parts) if root is not None else Path(*parts)


def checkpoints_dir() -> Path:
    """The bundled checkpoints: the checkout's checkpoints/, or checkpoints/ in the working directory."""
    return checkout_path("checkpoints")


def cache_root() -> Path:
    """What attnlens makes once and keeps (converted packaged models, the packed-weights kernel):
    $ATTNLENS_CACHE_DIR, else $XDG_CACHE_HOME/attnlens, else ~/.cache/attnlens."""
    if os.environ.get("ATTNLENS_CACHE_DIR"):
        return Path(os.environ["ATTNLENS_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "attnlens"
