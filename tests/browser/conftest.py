"""Fixtures of the browser tests: Playwright for Python driving Debian's Chromium against real
`attnlens serve` processes on free localhost ports. Skipped (with the reason) without the
playwright package or /usr/bin/chromium; never downloads a browser."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from conftest import REPO_ROOT, TINY_TEXT, make_tiny_checkpoint
from live_server import live_server

CHROMIUM = Path(os.environ.get("ATTNLENS_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}

try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - depends on the environment
    sync_playwright = None


def _skip_reason() -> str | None:
    if sync_playwright is None:
        return "the playwright Python package is not installed (pip install playwright; no browser download needed)"
    if not (CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)) and not shutil.which(str(CHROMIUM)):
        return f"{CHROMIUM} not found: install Debian's Chromium (apt-get install chromium)"
    return None


@pytest.hookimpl(tryfirst=True)  # before -m selects on the browser mark
def pytest_collection_modifyitems(config, items):
    reason = _skip_reason()
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).parent == here:
            item.add_marker(pytest.mark.browser)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def server(tiny_checkpoint, tmp_path_factory):
    """The tiny random model (2 layers × 4 heads, context 64)."""
    with live_server(tiny_checkpoint, tmp_path_factory.mktemp("browser-logs")) as srv:
        yield srv


@pytest.fixture(scope="session")
def default_server(default_checkpoint, tmp_path_factory):
    """The bundled trained model: real text, and decode steps slow enough (milliseconds) that
    a stream reaches the page in several reads, unlike the tiny model's near-instant steps."""
    with live_server(default_checkpoint, tmp_path_factory.mktemp("browser-default-logs")) as srv:
        yield srv


@pytest.fixture(scope="session")
def encoder_server(tiny_checkpoint, tmp_path_factory):
    """The tiny decoder (the default) and a tiny random encoder named "genre", side by side."""
    from encoder_helpers import make_tiny_encoder

    enc = make_tiny_encoder(tmp_path_factory.mktemp("enc") / "genre", seed=6)
    env = {"ATTNLENS_MODELS": f"{tiny_checkpoint},{enc}"}
    with live_server(tiny_checkpoint, tmp_path_factory.mktemp("browser-enc-logs"), env=env) as srv:
        yield srv


BUNDLED = REPO_ROOT / "checkpoints"


@pytest.fixture(scope="session")
def bundled_server(tmp_path_factory):
    """The three bundled models side by side, as `attnlens serve` runs them: the decoder
    "default" (context 256), the encoder "encoder" and the translator "translator" (context 48)."""
    dirs = [BUNDLED / name for name in ("default", "encoder", "translator")]
    missing = [d.name for d in dirs if not (d / "model.safetensors").is_file()]
    if missing:
        pytest.skip(f"bundled checkpoints missing: {missing}")
    env = {"ATTNLENS_MODELS": ",".join(map(str, dirs))}
    with live_server(dirs[0], tmp_path_factory.mktemp("browser-bundled-logs"), env=env) as srv:
        yield srv


@pytest.fixture(scope="session")
def long_checkpoint(tmp_path_factory):
    """6 layers × 8 heads with a 256-token context: for long prompts."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ctx256") / "model", context_length=256, n_layers=6, n_heads=8, d_model=64, d_ff=128)


@pytest.fixture(scope="session")
def long_server(long_checkpoint, tmp_path_factory):
    with live_server(long_checkpoint, tmp_path_factory.mktemp("browser-long-logs")) as srv:
        yield srv


@pytest.fixture(scope="session")
def long_text(long_checkpoint):
    """A text of `n` tokens (at most 256) for the long-context model."""
    from attnlens.model import load_checkpoint

    tok = load_checkpoint(long_checkpoint).tokenizer

    def make(n: int) -> str:
        text = tok.decode(tok.encode(TINY_TEXT * 8)[:n])
        while len(tok.encode(text)) > n:
            text = text[:-1]
        return text

    make.tokenizer = tok
    return make


@pytest.fixture(scope="session")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


class Console:
    def __init__(self):
        self.messages: list[str] = []

    @property
    def errors(self) -> list[str]:
        return [m for m in self.messages if m.startswith(("error", "pageerror"))]


def _new_page(browser, **context_args):
    context = browser.new_context(color_scheme="light", accept_downloads=True, **context_args)
    pg = context.new_page()
    console = Console()
    pg.on("console", lambda m: console.messages.append(f"{m.type}: {m.text}"))
    pg.on("pageerror", lambda e: console.messages.append(f"pageerror: {e}"))
    pg.console_log = console
    pg.set_default_timeout(20_000)
    return context, pg


@pytest.fixture
def page(browser):
    context, pg = _new_page(browser, viewport=DESKTOP)
    try:
        yield pg
    finally:
        context.close()


@pytest.fixture
def phone(browser):
    """A 390×844 touch screen (an iPhone 12-sized phone)."""
    context, pg = _new_page(browser, viewport=PHONE, device_scale_factor=2, is_mobile=True, has_touch=True)
    try:
        yield pg
    finally:
        context.close()
