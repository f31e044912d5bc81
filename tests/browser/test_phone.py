"""The page on a 390×844 touch screen: one column, nothing wider than the screen, heatmaps
that fit the width and zoom / pan, tooltips on screen, a tap pins a row."""

from __future__ import annotations

from .helpers import open_page, overflow, rendered, screenshot, state, wait_rendered


def test_phone_layout_fits_the_screen(phone, server):
    open_page(phone, server)
    o = overflow(phone)
    assert o["scrollWidth"] <= 390 and not o["wide"], o
    # the theme button and every tab can be reached on screen
    box = phone.locator("#theme-toggle").bounding_box()
    assert box and box["x"] >= 0 and box["x"] + box["width"] <= 390, box
    for tab in phone.locator('[role="tab"]:visible').all():  # a family's own tabs hide for other models
        tab.scroll_into_view_if_needed()
        b = tab.bounding_box()
        assert b and b["x"] >= 0 and b["x"] + b["width"] <= 390, b
    # the sidebar is stacked above the views, not beside them
    side = phone.locator(".sidebar").bounding_box()
    work = phone.locator("#workspace").bounding_box()
    assert work["y"] >= side["y"] + side["height"] - 1
    # the heatmap fits the width at zoom 100 %
    host = phone.eval_on_selector("#view-host", "e => ({w: e.clientWidth, sw: e.scrollWidth})")
    assert host["sw"] <= host["w"], host
    assert not phone.console_log.errors, phone.console_log.errors
    screenshot(phone, "phone-head-view.png")
    # every view keeps within the screen (wide pictures pan inside their own frame)
    for view in ("model", "aggregate", "diff", "lines", "gen", "atlas", "lens", "ablate", "head"):
        r = rendered(phone)
        phone.tap(f"#tab-{view}")
        wait_rendered(phone, r, prefix=f"{view}:")
        o = overflow(phone)
        assert o["scrollWidth"] <= 390 and not o["wide"], (view, o)
        if view in ("model", "diff", "lines"):
            phone.locator("#workspace").scroll_into_view_if_needed()
            screenshot(phone, f"phone-{view}-view.png", full_page=False)
    assert not phone.console_log.errors, phone.console_log.errors


def test_phone_zoom_pans_inside_the_view(phone, server):
    open_page(phone, server)
    before = phone.evaluate("() => window.__attnlens.current().heatmap.layout.cellW")
    r = rendered(phone)
    phone.tap("#zoom-in")
    phone.tap("#zoom-in")
    wait_rendered(phone, r)
    after = phone.evaluate("() => window.__attnlens.current().heatmap.layout.cellW")
    assert after > before * 1.4, (before, after)
    assert state(phone, "s.zoom") > 1.5 and "zoom=" in phone.url
    host = phone.eval_on_selector("#view-host", "e => ({w: e.clientWidth, sw: e.scrollWidth})")
    assert host["sw"] > host["w"], "a zoomed heatmap must pan inside its frame"
    assert overflow(phone)["scrollWidth"] <= 390, "zooming must not widen the page"
    phone.eval_on_selector("#view-host", "e => e.scrollLeft = e.scrollWidth")
    assert phone.eval_on_selector("#view-host", "e => e.scrollLeft") > 0
    phone.tap("#zoom-fit")
    phone.wait_for_function("() => window.__attnlens.store.state.zoom === 1")


def test_tap_shows_the_tooltip_on_screen_and_pins_the_row(phone, server):
    open_page(phone, server)
    n = phone.evaluate("() => window.__attnlens.store.state.att.T")
    row, col = n - 1, n - 2  # the bottom-right corner: the tooltip must flip to stay on screen
    p = phone.evaluate(f"() => window.__attnlens.current().heatmap.cellCenter({row}, {col})")
    phone.evaluate(f"() => window.scrollTo(0, {p['y']} - 400 + window.scrollY)")
    p = phone.evaluate(f"() => window.__attnlens.current().heatmap.cellCenter({row}, {col})")
    phone.touchscreen.tap(p["x"], p["y"])
    phone.wait_for_selector("#tooltip:not([hidden])")
    tip = phone.locator("#tooltip").bounding_box()
    assert tip["x"] >= 0 and tip["x"] + tip["width"] <= 390, tip
    assert tip["y"] >= 0 and tip["y"] + tip["height"] <= 844, tip
    assert f"(#{row})" in phone.inner_text("#tooltip")
    phone.wait_for_function(f"() => window.__attnlens.store.state.pin.join() === '{row}'")
    assert f"pin={row}" in phone.url
    screenshot(phone, "phone-tooltip.png", full_page=False)


def test_phone_encoder_page_fits_the_screen(phone, encoder_server):
    """With several models the top bar has the model picker; the encoder's panels stack in
    the sidebar: nothing is wider than the screen."""
    phone.goto(f"{encoder_server.base_url}/?model=genre&prompt=the+queen+of+%5BMASK%5D")
    phone.wait_for_function("() => document.body.dataset.family === 'encoder'")
    wait_rendered(phone)
    phone.wait_for_selector("#fill-results .prob-row")
    assert phone.is_visible("#model-picker") and phone.is_visible("#fill-mask-panel")
    o = overflow(phone)
    assert o["scrollWidth"] <= 390 and not o["wide"], o
    box = phone.locator("#model-picker").bounding_box()
    assert box and box["x"] >= 0 and box["x"] + box["width"] <= 390, box
    screenshot(phone, "phone-encoder.png")
    assert not phone.console_log.errors, phone.console_log.errors
