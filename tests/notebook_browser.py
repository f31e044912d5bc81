"""Opening attnlens' notebook views in Debian's Chromium (Playwright) with the network off: which
requests the page tried, what each frame logged as an error, and what its canvases hold.
Never downloads a browser; without Playwright or /usr/bin/chromium the tests skip and say why."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

CHROMIUM = Path(os.environ.get("ATTNLENS_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]

try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - depends on the environment
    sync_playwright = None


def skip_reason() -> str | None:
    if sync_playwright is None:
        return "the playwright Python package is not installed (no browser download needed)"
    if not (CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)) and not shutil.which(str(CHROMIUM)):
        return f"{CHROMIUM} not found: install Debian's Chromium (apt-get install chromium)"
    return None


SKIP_REASON = skip_reason()
needs_chromium = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

# Runs first in every frame (the notebook's and each view's iframe): keeps its errors in the frame.
RECORD_ERRORS = """(() => {
  window.__frameErrors = [];
  const keep = (x) => window.__frameErrors.push(String(x && x.stack || x));
  window.addEventListener("error", (e) => keep(e.error || e.message), true);
  window.addEventListener("unhandledrejection", (e) => keep(e.reason));
  const error = console.error;
  console.error = (...args) => { keep(args.join(" ")); error.apply(console, args); };
})();"""

# Per visible canvas of a view (the heatmap's transparent hover overlay aside): its size and how
# many distinct colours it holds (a blank canvas has none; a drawn map many).
CANVASES = """() => [...document.querySelectorAll("canvas")]
  .filter((c) => c.offsetParent !== null && !c.classList.contains("heatmap-overlay"))
  .map((c) => {
    const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
    const colours = new Set();
    for (let i = 0; i < d.length && colours.size < 64; i += 4) if (d[i + 3]) colours.add((d[i] << 16) | (d[i + 1] << 8) | d[i + 2]);
    return { cls: c.className || c.parentElement.className, width: c.width, height: c.height, colours: colours.size };
  })"""


@dataclass
class Visit:
    """What happened while a page was open: every request it tried (url, frame url) and the
    console errors and uncaught exceptions Playwright saw."""

    requests: list[tuple[str, str]] = field(default_factory=list)
    console_errors: list[tuple[str, str]] = field(default_factory=list)  # (text, source url)
    page_errors: list[str] = field(default_factory=list)


@contextlib.contextmanager
def offline_browser():
    """A Chromium context with the network off (open_offline records and aborts every request
    but the page's own file)."""
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1200, "height": 900}, offline=True)
            context.add_init_script(RECORD_ERRORS)
            yield context
        finally:
            browser.close()


def in_browser(work):
    """work(context) with an offline Chromium context, on a thread of its own: the browser tests'
    session-long Playwright keeps an event loop running on this thread, and Playwright's sync API
    refuses a thread that has one. What work raises (a failed assert) is raised here."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    result: dict = {}

    def target():
        try:
            with offline_browser() as context:
                result["value"] = work(context)
        except BaseException as e:  # re-raised in the test's thread
            result["error"] = e

    thread = threading.Thread(target=target, name="notebook-browser")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result.get("value")


def open_offline(context, path: Path, visit: Visit):
    """Open a local HTML file, recording into `visit`; returns the page."""
    def route(r):
        visit.requests.append((r.request.url, r.request.frame.url))
        if r.request.url == path.as_uri():
            r.continue_()
        else:
            r.abort()

    page = context.new_page()
    page.route("**/*", route)
    page.on("console", lambda m: m.type == "error" and visit.console_errors.append((m.text, m.location.get("url", ""))))
    page.on("pageerror", lambda e: visit.page_errors.append(str(e)))
    page.goto(path.as_uri())
    return page


def view_frames(page) -> list:
    """The frames of attnlens' views (iframes from attnlens.show), in document order."""
    handles = page.query_selector_all("iframe.attnlens-view")
    return [h.content_frame() for h in handles]


def wait_drawn(frame, timeout: float = 20_000) -> None:
    frame.wait_for_function("() => window.__attnlens && window.__attnlens.drawn === true", timeout=timeout)


def frame_state(frame) -> dict:
    """A view frame's own record: drawn, renders, its errors, its canvases and the host's marker."""
    return frame.evaluate(f"""() => ({{
      drawn: window.__attnlens?.drawn, renders: window.__attnlens?.renders, viewErrors: window.__attnlens?.errors,
      errors: window.__frameErrors, canvases: ({CANVASES})(),
      rendered: document.querySelector(".view-host")?.dataset.rendered ?? null,
      probRows: document.querySelectorAll(".prob-row").length,
      caption: document.querySelector(".caption")?.textContent ?? "",
    }})""")


def assert_drawn(state: dict, what: str) -> None:
    """The view drew, with no error of its own, and every visible canvas holds a picture."""
    assert state["drawn"] is True, (what, state)
    assert state["errors"] == [] and state["viewErrors"] == [], (what, state["errors"], state["viewErrors"])
    for c in state["canvases"]:
        assert c["width"] > 0 and c["height"] > 0 and c["colours"] >= 2, (what, c)
