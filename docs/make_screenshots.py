"""Make the docs' screenshots of the page: docs/images/page-<view>.png, one per view the docs show.

Starts `attnlens serve` with its default models (SmolLM2-135M-Instruct, the default; or takes
--url of a running server), opens the page in headless Chromium (Debian's /usr/bin/chromium,
driven by Playwright; nothing is downloaded), generates from a fixed prompt with a fixed seed on
SmolLM2 (and on the translator, for its three views), then clicks every view's tab and saves the
window at 1280 x 800.

    PYTHONPATH=. .venv/bin/python docs/make_screenshots.py                    # start a server
    PYTHONPATH=. .venv/bin/python docs/make_screenshots.py --url http://127.0.0.1:8000

The views are the page's own ids (static/js/views/registry.js); tests/api/test_docs_views.py fails
when one the docs show is renamed or gone. PNGs are written with Chromium's own encoder; each
is 1280 wide and a few hundred KB at most.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from urllib.parse import urlencode

ROOT = Path(__file__).resolve().parent.parent
IMAGES = Path(__file__).resolve().parent / "images"
# per model: the prompt it generates from (greedy, seed 1) and the views shot, in tab order
SHOTS = {
    "smollm2-135m-instruct": ("The capital of France is Paris. The capital of Italy is",
                              ["head", "model", "atlas", "aggregate", "diff", "lines", "gen", "lens", "ablate"]),
    "translator": ("Wednesday, March 3, 2021", ["cross", "align", "decoder"]),
}
VIEWS = [v for _, views in SHOTS.values() for v in views]  # every view the docs show
SETTLE_MS = {"atlas": 2000, "lens": 2000, "model": 2000}


@contextlib.contextmanager
def server(url: str | None):
    if url:
        yield url.rstrip("/")
        return
    sys.path.insert(0, str(ROOT))
    import attnlens

    with attnlens.Server(env={"ATTNLENS_DEVICE": "cpu"}, log=ROOT / "test-artifacts" / "screenshots-server.log") as s:
        yield s.url


def shoot(browser, base: str, model: str, prompt: str, views: list[str], out: Path, errors: list[str]) -> None:
    """Generate from `prompt` on `model`, then save each view's tab as out/page-<view>.png."""
    page = browser.new_page(viewport={"width": 1280, "height": 800}, device_scale_factor=1)
    page.on("pageerror", lambda e: errors.append(f"{model}: {e}"))
    query = urlencode({"model": model, "prompt": prompt, "seed": 1, "temperature": 0, "max_new_tokens": 24})
    page.goto(f"{base}/?{query}", wait_until="networkidle")
    page.fill("#prompt", prompt)
    page.click("#generate")
    # the generation is over when Stop is disabled again
    page.wait_for_function("document.querySelector('#stop-btn').disabled === true", timeout=120_000)
    page.wait_for_timeout(1500)
    for view in views:
        tab = page.locator(f'[role="tab"][data-view="{view}"]')
        if tab.count() == 0:
            raise SystemExit(f"the page has no tab for the view {view!r} (static/js/views/registry.js)")
        tab.first.click()
        page.wait_for_load_state("networkidle")
        if view == "ablate":  # zero one head (layer 18, head 6: the atlas's first induction head)
            host = page.locator("#view-host")
            host.locator("select[name=layer]").select_option(label="L18")
            host.locator("select[name=head]").select_option(label="H6")
            host.get_by_role("button", name="Add head").click()
            page.wait_for_function("!document.querySelector('#view-host').innerText.includes('generating with')",
                                   timeout=180_000)
        page.wait_for_timeout(SETTLE_MS.get(view, 1500))
        # whatever the view asked the server for has come back: the page's spinner is hidden
        page.wait_for_function("document.querySelector('#spinner').hidden", timeout=180_000)
        page.wait_for_timeout(500)
        path = out / f"page-{view}.png"
        page.screenshot(path=str(path))
        print(f"{path.relative_to(ROOT)}  {path.stat().st_size // 1024} KB")
    page.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server (default: start one)")
    ap.add_argument("--out", type=Path, default=IMAGES)
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--views", nargs="*", default=VIEWS)
    a = ap.parse_args(argv)
    from playwright.sync_api import sync_playwright

    (ROOT / "test-artifacts").mkdir(exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    with server(a.url) as base, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=a.chromium, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        errors: list[str] = []
        for model, (prompt, views) in SHOTS.items():
            views = [v for v in views if v in a.views]
            if views:
                shoot(browser, base, model, prompt, views, a.out, errors)
        browser.close()
    if errors:
        print("page errors:\n" + "\n".join(errors), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    t0 = time.monotonic()
    rc = main()
    print(f"{time.monotonic() - t0:.0f} s")
    sys.exit(rc)
