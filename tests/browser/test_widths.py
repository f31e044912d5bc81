"""Nothing on the page is wider than the window, from a 360 px phone to a 1920 px screen, for
each bundled model (decoder, encoder, translator) and each of its views, after a generation
where the model generates (issue 20: between 761 and 1280 px the page used to spill off the
right edge, with the theme button cut and tabs off-screen)."""

from __future__ import annotations

import pytest

from .helpers import rendered, screenshot, spill, wait_rendered

WIDTHS = [360, 390, 768, 1024, 1280, 1920]
MODELS = ["default", "encoder", "translator"]


def in_view(page, selector: str, vw: int) -> None:
    for el in page.locator(selector).all():
        el.scroll_into_view_if_needed()
        box = el.bounding_box()
        assert box and box["x"] >= 0 and box["x"] + box["width"] <= vw + 1, (selector, box, vw)


@pytest.mark.parametrize("width", WIDTHS)
def test_every_model_and_view_fits_the_width(browser, bundled_server, width):
    context = browser.new_context(viewport={"width": width, "height": 900}, color_scheme="light")
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.set_default_timeout(30_000)
    try:
        for model in MODELS:
            page.goto(f"{bundled_server.base_url}/?model={model}")
            page.wait_for_function(f"() => window.__attnlens.store.state.meta?.name === '{model}'")
            wait_rendered(page)
            if page.is_visible("#generate"):
                page.fill("#max_new_tokens", "6")
                page.fill("#temperature", "0")
                r = rendered(page)
                page.click("#generate")
                page.wait_for_selector("#output[data-done]", state="attached")
                wait_rendered(page, r)
            in_view(page, "#theme-toggle, #copy-link, #model-picker", width)
            in_view(page, '[role="tab"]:visible', width)
            for tab in page.locator('[role="tab"]:visible').all():
                view = tab.get_attribute("data-view")
                if tab.get_attribute("aria-selected") != "true":
                    r = rendered(page)
                    tab.click()
                    wait_rendered(page, r, prefix=f"{view}:")
                s = spill(page)
                assert s["scrollWidth"] <= width and not s["wide"], (model, view, s)
            screenshot(page, f"width-{width}-{model}.png")
        assert not errors, errors
    finally:
        context.close()
