"""The wheel: built from the repository, installed into a fresh venv, it is the package `attnlens`
and nothing else (no top-level `app` or `model`), its base install needs only httpx and numpy,
and it carries the page (static/) that `attnlens serve` and the notebook views need.

Offline and fast: the wheel is built in-process by setuptools (no build isolation) from a copy
of the sources, installed without its dependencies, and the fresh venv borrows this venv's
site-packages for httpx and numpy through a path line (no .pth of ours runs there, so this
checkout's editable install stays out of it)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from conftest import REPO_ROOT

pytestmark = pytest.mark.slow

SOURCES = ["pyproject.toml", "README.md", "attnlens", "app", "model", "static"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        path = REPO_ROOT / name
        if path.is_dir():
            # as a clone has them: attnlens/app, attnlens/model, attnlens/static are relative links
            shutil.copytree(path, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run([sys.executable, "-c", f"from setuptools import build_meta as b; print(b.build_wheel({str(out)!r}))"],
                          cwd=src, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out / done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed (no dependencies) and this venv's packages last on its path."""
    root = tmp_path_factory.mktemp("venv") / "fresh"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                           "--quiet", str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return root


def run(venv: Path, code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_the_wheel_holds_one_package_and_the_page(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"attnlens"}
    for needed in ("attnlens/__init__.py", "attnlens/client.py", "attnlens/app/server/main.py", "attnlens/model/__init__.py",
                   "attnlens/model/families/decoder.py", "attnlens/app/engine/__main__.py",
                   "attnlens/static/index.html", "attnlens/static/css/style.css", "attnlens/static/js/inline.js",
                   "attnlens/static/js/main.js", "attnlens/static/js/views/headview.js",
                   "attnlens/static/js/translator/crossview.js", "attnlens/static/favicon.svg"):
        assert needed in names, needed
    native = {n.removeprefix("attnlens/model/native/") for n in names if n.startswith("attnlens/model/native/")}
    kernels = {p.name for p in (REPO_ROOT / "model" / "native").iterdir() if p.suffix in (".c", ".h")}
    assert kernels <= native, "the C kernels' sources and headers are compiled where the wheel is installed"
    js = {n.removeprefix("attnlens/static/") for n in names if n.startswith("attnlens/static/js/")}
    assert js == {str(p.relative_to(REPO_ROOT / "static")) for p in (REPO_ROOT / "static" / "js").rglob("*.js")}


def test_the_wheel_holds_files_not_links(wheel):
    with zipfile.ZipFile(wheel) as z:
        links = [i.filename for i in z.infolist() if (i.external_attr >> 16) & 0o170000 == 0o120000]
    assert links == []


def test_its_base_requirements_are_light_and_the_server_is_an_extra(wheel):
    with zipfile.ZipFile(wheel) as z:
        meta = Parser().parsestr(z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode())
    requires = meta.get_all("Requires-Dist")
    base = sorted(r.split(">")[0].split("=")[0] for r in requires if "extra ==" not in r)
    assert base == ["httpx", "numpy"]
    extras = {r.split("extra ==")[1].strip().strip("\"'") for r in requires if "extra ==" in r}
    assert {"model", "server", "train", "dev"} <= extras
    torch = [r for r in requires if r.startswith("torch")]
    assert torch and all('extra == "model"' in r for r in torch)
    assert any(r.startswith("fastapi") and 'extra == "server"' in r for r in requires)


def test_a_fresh_venv_imports_attnlens_and_not_model(venv, tmp_path):
    # run from an empty directory: nothing of the checkout is on the path
    done = run(venv, """
import json, sys
sys.modules["torch"] = sys.modules["fastapi"] = None   # the base install works without them
import attnlens, attnlens.resources as r
found = {}
for name in ("model", "app"):
    try:
        __import__(name)
        found[name] = "imported"
    except ImportError as e:
        found[name] = type(e).__name__
print(json.dumps({"file": attnlens.__file__, "client": attnlens.Client.__module__, "static": str(r.static_dir()),
                  "checkout": r.source_root(), "found": found}))
""", tmp_path)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["file"].startswith(str(venv)) and out["client"] == "attnlens.client"
    assert out["found"] == {"model": "ModuleNotFoundError", "app": "ModuleNotFoundError"}
    assert out["checkout"] is None and out["static"].startswith(str(venv))
    assert Path(out["static"], "js", "inline.js").is_file()


def test_the_installed_notebook_views_and_server_find_the_page(venv, tmp_path):
    done = run(venv, """
import sys
sys.modules["torch"] = None
import numpy as np, attnlens
a = attnlens.Attention.from_arrays(model="m", family="decoder", direction="causal",
    tokens=[attnlens.Token(0, "a"), attnlens.Token(1, "b")], n_layers=1, n_heads=1, layers=[0], heads=[0],
    format="json", specs=[attnlens.GroupSpec("attention", "tokens", "tokens", True)],
    maps={"attention": np.array([[[[1, 0], [0.5, 0.5]]]], dtype=np.float32)})
html = attnlens.show(a).html()
print(len(html), "attnlens/views/headview.js" in html)
""", tmp_path)
    assert done.returncode == 0, done.stderr
    size, has_views = done.stdout.split()
    assert int(size) > 50_000 and has_views == "True"
    done = run(venv, "from attnlens.app.server.settings import Settings; s = Settings(packaged_models=False); print(s.static_dir, s.model)",
               tmp_path)
    assert done.returncode == 0, done.stderr
    static, model = done.stdout.split()
    assert static.startswith(str(venv)) and Path(static, "index.html").is_file()
    assert model == "checkpoints/default"  # a wheel has no bundled models: the working directory's
    cli = subprocess.run([str(venv / "bin" / "python"), "-m", "attnlens.app.cli", "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and "serve" in cli.stdout


def test_a_command_without_its_extra_says_which_to_install(venv, tmp_path):
    done = run(venv, """
import sys
sys.modules["fastapi"] = None   # as in a base install: no server dependencies
from attnlens.app.cli.commands import main
sys.exit(main(["serve", "--port", "0"]))
""", tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == ("attnlens serve: error: the module 'fastapi' is not installed: "
                                   "pip install 'attnlens[server]'")


def test_the_dockerfile_builds_the_wheel_from_the_same_sources():
    """The image installs the wheel this module builds: every source it needs is copied in, the
    server extra is what it installs, and no source folder is left where the server runs."""
    text = (REPO_ROOT / "Dockerfile").read_text()
    copied = {part.rstrip("/") for line in text.splitlines() if line.startswith("COPY ")
              for part in line.split()[1:-1]}
    assert set(SOURCES) <= copied, set(SOURCES) - copied
    assert 'pip install "/tmp/attnlens-src[server]" && rm -rf /tmp/attnlens-src' in text
    assert "ATTNLENS_STATIC_DIR" not in text  # the installed package finds its page
