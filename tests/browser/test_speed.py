"""How long each view takes from the click on its tab to its picture on screen, at the bundled
default model's full context (256 tokens × 4 layers × 8 heads = 32 maps). The figures are
printed and written to test-artifacts/view-speed.json; nothing here asserts a time (the
machine is shared), only that every view drew the whole sequence."""

from __future__ import annotations

import json
import urllib.parse

import pytest
from conftest import TINY_TEXT

from .conftest import DESKTOP
from .helpers import ARTIFACTS, rendered, wait_rendered

# (tab, what to wait for besides the view's `rendered` mark)
STEPS = [("model", "thumbs"), ("lines", None), ("head", None), ("diff", None), ("aggregate", None), ("model", "thumbs")]

CLICK_TO_DRAWN = """(view) => {
    // window.__drawnMs: the ms from the click to the first frame after the view finished
    window.__drawnMs = null;
    const resolve = (ms) => { window.__drawnMs = ms; };
    const done = () => {
        const r = document.querySelector('#view-host').dataset.rendered || '';
        if (!r.startsWith(view.name + ':') || r === view.before || document.documentElement.hasAttribute('data-busy')) return false;
        if (view.wait === 'thumbs') return document.querySelectorAll('#view-host .thumb').length > 0 && !document.querySelector('#view-host .thumb.loading');
        return true;
    };
    const poll = () => (done() ? requestAnimationFrame(() => resolve(performance.now() - window.__clickAt)) : requestAnimationFrame(poll));
    poll();
}"""


def drawn_ms(pg) -> float:
    pg.wait_for_function("() => window.__drawnMs != null", timeout=60_000)
    return pg.evaluate("() => window.__drawnMs")


def drawn_size(pg, name: str) -> int:
    """How many tokens the view on screen drew (the model view: every one of its 32 maps)."""
    if name == "model":
        return pg.evaluate("""() => { const c = [...document.querySelectorAll('#view-host .thumb:not(.loading) canvas')];
            return c.length === 32 && c.every(x => x.width === c[0].width) ? c[0].width : -c.length; }""")
    if name == "lines":
        return pg.evaluate("() => window.__attnlens.current().matrix.T")
    return pg.evaluate("() => window.__attnlens.current().heatmap.model.rows")


@pytest.fixture(scope="module")
def full_context_text(default_checkpoint):
    from attnlens.model import load_checkpoint

    tok = load_checkpoint(default_checkpoint).tokenizer
    n = load_checkpoint(default_checkpoint).config.context_length
    text = tok.decode(tok.encode(TINY_TEXT * 12)[:n])
    while len(tok.encode(text)) > n:
        text = text[:-1]
    return text


def test_each_view_at_full_context_reports_click_to_drawn(browser, default_server, full_context_text):
    context = browser.new_context(viewport=DESKTOP, color_scheme="light")
    pg = context.new_page()
    figures = []
    try:
        # opening the page: from navigation to the head view drawn (its fetch included)
        pg.add_init_script("window.__clickAt = 0; window.addEventListener('DOMContentLoaded', () => ("
                           + CLICK_TO_DRAWN + ")({name: 'head', before: '', wait: null}));")
        pg.goto(f"{default_server.base_url}/?{urllib.parse.urlencode({'prompt': full_context_text})}")
        wait_rendered(pg, prefix="head:")
        figures.append({"view": "open the page (head)", "click_to_drawn_ms": round(drawn_ms(pg), 1)})
        T = pg.evaluate("() => window.__attnlens.store.state.att.T")
        meta = pg.evaluate("() => { const m = window.__attnlens.store.state.meta; return [m.n_layers, m.n_heads]; }")
        assert T >= 250 and meta[0] * meta[1] == 32, (T, meta)
        pg.evaluate("() => document.addEventListener('click', () => { window.__clickAt = performance.now(); }, true)")
        pg.wait_for_timeout(500)  # let the first view's follow-up work settle before timing
        for name, wait in STEPS:
            before = rendered(pg)
            pg.evaluate(CLICK_TO_DRAWN, {"name": name, "before": before, "wait": wait})
            pg.click(f"#tab-{name}")
            ms = drawn_ms(pg)
            wait_rendered(pg, before, prefix=f"{name}:")
            figures.append({"view": name, "click_to_drawn_ms": round(ms, 1)})
            assert drawn_size(pg, name) == T, name
        # the same view, another head: the work a class does most (pick a head, look)
        for name in ("head", "lines"):
            before = rendered(pg)
            pg.click(f"#tab-{name}")
            wait_rendered(pg, before, prefix=f"{name}:")
            before = rendered(pg)
            pg.evaluate(CLICK_TO_DRAWN, {"name": name, "before": before, "wait": None})
            pg.evaluate("() => { window.__clickAt = performance.now(); }")
            pg.select_option("#head", "5")
            ms = drawn_ms(pg)
            wait_rendered(pg, before, prefix=f"{name}:")
            figures.append({"view": f"{name} (another head)", "click_to_drawn_ms": round(ms, 1)})
            pg.select_option("#head", "0")
            wait_rendered(pg)
    finally:
        context.close()
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "view-speed.json").write_text(json.dumps({"tokens": T, "maps": 32, "figures": figures}, indent=1))
    print(f"\nclick to drawn, {T} tokens x 32 heads (default model, Chromium, this machine):")
    for f in figures:
        print(f"  {f['view']:<22} {f['click_to_drawn_ms']:8.1f} ms")
