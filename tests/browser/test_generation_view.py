"""The Generation view (issue 12): shared links rebuild it, it follows a stream live while the
other views say they are stale, it names the query correctly, a generation without attention
shows only its note, and a long prompt keeps rows and labels legible."""

from __future__ import annotations

import pytest

from .helpers import (
    api_attention,
    end_stream,
    feed_stream,
    generate_with,
    generation_events,
    open_page,
    overflow,
    rendered,
    screenshot,
    state,
    visible,
    wait_rendered,
)

PROMPT = "To be, or not"
MORE = " to be, that is the question"


@pytest.fixture
def events(server):
    gen_ids = [t["id"] for t in api_attention(server, text=MORE)["tokens"]]
    return generation_events(server, PROMPT, gen_ids)


def generated(page, server, events):
    open_page(page, server)
    page.fill("#prompt", PROMPT)
    r = rendered(page)
    generate_with(page, events)
    return wait_rendered(page, r, prefix="head:")


def gen_result(page) -> dict:
    return page.evaluate("""() => { const r = window.__attnlens.current().result;
        return {step: r.step, S: r.S, P: r.P, data: Array.from(r.data, v => Math.round(v * 1e4) / 1e4)}; }""")


def test_shared_link_rebuilds_the_generation_view(page, browser, server, events):
    generated(page, server, events)
    r = rendered(page)
    page.click('#output .tok.gen[data-step="4"]')
    wait_rendered(page, r, prefix="gen:")
    sent = gen_result(page)
    strip = page.inner_text(".gen-strip")
    url = page.url
    assert "ids=" in url and "plen=" in url and "view=gen" in url and "step=4" in url
    other = browser.new_context(viewport={"width": 1280, "height": 900})
    try:
        pg = other.new_page()
        pg.goto(url)
        wait_rendered(pg, prefix="gen:")
        pg.wait_for_function("() => window.__attnlens.current()?.result")
        got = gen_result(pg)
        assert got["step"] == 4 and got["S"] == sent["S"] and got["P"] == sent["P"]
        assert got["data"] == pytest.approx(sent["data"], abs=2e-3)
        assert pg.inner_text(".gen-strip") == strip
        assert pg.locator("#output .tok.gen").count() == len(events) - 1
        # the head view of the link is the generation's analysis, with its boundary
        r = rendered(pg)
        pg.click("#tab-head")
        wait_rendered(pg, r, prefix="head:")
        assert pg.evaluate("() => window.__attnlens.current().heatmap.model.boundary") == sent["P"]
    finally:
        other.close()


def test_generation_without_attention_shows_only_its_note(page, server, events):
    # first a generation with attention, its Generation view on screen (caption and legend) …
    generated(page, server, events)
    r = rendered(page)
    page.click("#tab-gen")
    wait_rendered(page, r, prefix="gen:")
    assert page.is_visible("#legend-wrap") and page.inner_text("#caption").strip()
    # … then one without: the view shows its note and nothing of the previous picture
    gen_ids = [t["id"] for t in api_attention(server, text=MORE)["tokens"]]
    r = rendered(page)
    generate_with(page, generation_events(server, PROMPT, gen_ids, record=False), record=False)
    page.wait_for_function("() => document.querySelector('.gen-strip').innerText.includes('did not record attention')")
    wait_rendered(page, r, prefix="gen:")
    assert page.inner_text("#caption").strip() == ""
    assert page.is_hidden("#legend-wrap")
    assert page.evaluate("() => { const w = document.querySelector('#view-host .heatmap'); return !w || w.hidden; }")
    path_or_none = []
    page.on("download", lambda d: path_or_none.append(d))
    page.click("#export-png")
    page.wait_for_selector("#messages .message.warn")
    assert not path_or_none


def test_views_follow_a_streaming_generation(page, server, events):
    open_page(page, server)
    page.fill("#prompt", PROMPT)
    from .helpers import control_generate_stream

    control_generate_stream(page)
    page.click("#generate")
    feed_stream(page, *events[0])
    # the head view still shows the previous text: it says so
    page.wait_for_selector(".view-frame.stale .stale-note", state="visible")
    # the generation view follows the tokens as they arrive
    r = rendered(page)
    page.click("#tab-gen")
    wait_rendered(page, r, prefix="gen:")
    assert "step 1 / 1 (arriving…)" in page.inner_text("#gen-step-text")
    assert not page.is_visible(".stale-note")
    feed_stream(page, *events[1])
    page.wait_for_function("() => document.querySelector('#gen-step-text').innerText.startsWith('step 2 / 2')")
    feed_stream(page, *events[2])
    page.wait_for_function("() => document.querySelector('#gen-step-text').innerText.startsWith('step 3 / 3')")
    for e in events[3:]:
        feed_stream(page, *e)
    end_stream(page)
    page.wait_for_selector("#output[data-done]", state="attached")
    page.wait_for_function("() => !document.querySelector('.view-frame').classList.contains('stale')")
    n = len(events) - 1
    page.wait_for_function(f"() => document.querySelector('#gen-step-text').innerText.startsWith('step {n} / {n}:')")
    r = rendered(page)
    page.click("#tab-head")
    wait_rendered(page, r, prefix="head:")
    assert state(page, "s.att.T") == state(page, "s.plen") + n


def test_generation_tooltip_names_the_query_position(page, server, events):
    generated(page, server, events)
    r = rendered(page)
    page.click('#output .tok.gen[data-step="2"]')
    wait_rendered(page, r, prefix="gen:")
    res = gen_result(page)
    keys = page.evaluate("() => window.__attnlens.current().result.keys.map(t => t.text)")
    target = page.evaluate("() => window.__attnlens.current().result.target.text")
    q = res["S"] - 1
    p = page.evaluate("() => window.__attnlens.current().heatmap.cellCenter(1, 0)")
    page.mouse.move(p["x"], p["y"])
    page.wait_for_selector("#tooltip:not([hidden])")
    tip = page.inner_text("#tooltip")
    assert f"query “{visible(keys[q])}” (#{q})" in tip, tip
    assert f"predicting the next token, “{visible(target)}”" in tip
    assert f"key “{visible(keys[0])}” (#0)" in tip


def test_long_prompt_generation_view_stays_legible(page, long_server, long_text):
    text = long_text(200)
    open_page(page, long_server, prompt=text)
    page.fill("#max_new_tokens", "45")
    page.fill("#temperature", "0")
    page.fill("#seed", "3")
    r = rendered(page)
    page.click("#generate")
    page.wait_for_selector("#output[data-done]", state="attached", timeout=120_000)
    wait_rendered(page, r, prefix="head:")
    r = rendered(page)
    page.click('#output .tok.gen[data-step="44"]')
    wait_rendered(page, r, prefix="gen:")
    L = page.evaluate("() => { const l = window.__attnlens.current().heatmap.layout; return {cellW: l.cellW, cellH: l.cellH, colStep: l.colStep, rows: window.__attnlens.current().result.rows, cols: window.__attnlens.current().result.cols}; }")
    assert L["rows"] == 48 and L["cols"] >= 244, L
    assert L["cellH"] >= 14, L  # one row per head, legible
    assert L["cellW"] * L["colStep"] >= 12, L  # labels drawn at least 12 px apart
    heat = page.eval_on_selector(".gen-heat", "e => ({w: e.clientWidth, sw: e.scrollWidth})")
    assert heat["sw"] > heat["w"], "a wide map scrolls inside its frame"
    strip = page.eval_on_selector(".gen-strip", "e => e.getBoundingClientRect().right")
    assert strip <= 1280
    o = overflow(page)
    assert o["scrollWidth"] <= 1280 and not o["wide"], o
    screenshot(page, "browser-generation-long.png", full_page=False)
