"""The package in a checkout: one import name whose client loads on first use, and the page,
checkpoints and data found beside it (the wheel's side is tests/api/test_wheel.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT


def python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_importing_the_server_does_not_load_the_client():
    out = json.loads(python("""
import json, sys
import attnlens.app.serving.attention_codec, attnlens.app.server.settings
before = {m: m in sys.modules for m in ("httpx", "attnlens.client", "attnlens.inline")}
import attnlens
client = attnlens.Client
print(json.dumps({"before": before, "after": "httpx" in sys.modules, "client": client.__module__,
                  "local": attnlens.local.__name__}))
"""))
    assert out["before"] == {"httpx": False, "attnlens.client": False, "attnlens.inline": False}
    assert out["after"] is True and out["client"] == "attnlens.client" and out["local"] == "attnlens.local"


def test_model_and_app_are_only_under_attnlens():
    for name in ("model", "app"):
        done = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True, cwd="/")
        assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr


def test_the_import_name_is_the_path():
    """attnlens/app, attnlens/model and attnlens/static are relative links to the top-level folders,
    so an editor or type checker resolves attnlens.model.x to model/x.py; the modules load through them."""
    import attnlens.app.server.settings
    import attnlens.model.config

    for name in ("app", "model", "static"):
        link = REPO_ROOT / "attnlens" / name
        assert link.is_symlink() and str(link.readlink()) == f"../{name}", link
        assert link.resolve() == (REPO_ROOT / name).resolve()
    assert Path(attnlens.model.config.__file__).resolve() == (REPO_ROOT / "model" / "config.py").resolve()
    assert Path(attnlens.app.server.settings.__file__).resolve() == (REPO_ROOT / "app" / "server" / "settings.py").resolve()


def test_a_checkout_finds_its_page_checkpoints_and_data():
    from attnlens import resources
    from attnlens.app.cli import commands as cli
    from attnlens.app.server import settings

    assert resources.source_root() == REPO_ROOT
    assert resources.static_dir() == REPO_ROOT / "static" == settings.STATIC_DIR
    assert resources.checkpoints_dir() == REPO_ROOT / "checkpoints" == settings.CHECKPOINTS_DIR
    assert cli.DEFAULT_MODEL == REPO_ROOT / "checkpoints" / "default"
    assert resources.checkout_path("data", "shakespeare") == REPO_ROOT / "data" / "shakespeare"


@pytest.mark.parametrize(("command", "module", "extra"), [
    ("serve", "torch", "server"), ("serve", "fastapi", "server"), ("info", "torch", "model"),
    ("train", "matplotlib", "train"), ("prepare-data", "torch", "train"), ("generate", "tokenizers", "model"),
])
def test_a_missing_module_names_the_extra_that_brings_it(command, module, extra):
    from attnlens.app.cli.commands import missing_module_message

    message = missing_module_message(command, ModuleNotFoundError(f"No module named '{module}'", name=module))
    assert message == f"attnlens {command}: error: the module '{module}' is not installed: pip install 'attnlens[{extra}]'"
    other = missing_module_message("export-hf", ModuleNotFoundError("No module named 'transformers'", name="transformers"))
    assert other.endswith("pip install transformers")
