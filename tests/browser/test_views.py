"""Each view draws what it says: no stale pictures, honest statistics and legends, a working
Scale menu in the difference view, both token axes for two prompts, the prompt / generation
boundary on the head view's axes (issue 12)."""

from __future__ import annotations

import urllib.parse

import pytest

from .helpers import (
    PROMPT,
    api_attention,
    canvas_digest,
    generate_with,
    generation_events,
    open_page,
    rendered,
    state,
    wait_rendered,
)


def heatmap_shown(page) -> bool:
    return page.evaluate("() => { const w = document.querySelector('#view-host .heatmap'); return !!w && !w.hidden && w.offsetHeight > 0; }")


def test_aggregate_with_no_layer_shows_no_stale_heatmap_and_exports_nothing(page, server):
    open_page(page, server, view="aggregate")
    assert heatmap_shown(page)
    r = rendered(page)
    for box in page.locator("#agg-layers input").all():
        box.uncheck()
    wait_rendered(page, r)
    assert state(page, "s.layers") == []
    assert not heatmap_shown(page), "the old aggregate stayed on screen"
    assert page.is_hidden("#legend-wrap")
    assert "at least one layer" in page.inner_text("#caption")
    downloads = []
    page.on("download", lambda d: downloads.append(d))
    page.click("#export-png")
    page.wait_for_selector("#messages .message.warn")
    assert "nothing to export" in page.inner_text("#messages") and not downloads


def test_difference_with_empty_prompt_b_shows_no_stale_heatmap(page, server):
    open_page(page, server, view="diff")
    assert heatmap_shown(page)
    r = rendered(page)
    page.check('input[name="diff"][value="prompts"]')
    wait_rendered(page, r)
    assert not heatmap_shown(page)
    assert page.is_hidden("#legend-wrap")
    assert "second prompt" in page.inner_text("#caption")


def test_difference_scale_menu_changes_the_picture(page, server):
    open_page(page, server, view="diff")
    seen = {}
    for scale in ("p99", "max", "unit", "row", "sqrt"):
        r = rendered(page)
        page.select_option("#scale", scale)
        if scale != "p99":
            wait_rendered(page, r)
        seen[scale] = (canvas_digest(page)["hash"], page.inner_text("#legend-label"))
    hashes = {h for h, _ in seen.values()}
    labels = {lab for _, lab in seen.values()}
    assert len(hashes) == 5, seen
    assert len(labels) == 5, seen


def test_head_statistics_use_the_same_rows(page, server):
    open_page(page, server, layer="1", head="2")
    att = api_attention(server, text=PROMPT)["attention"][1][2]
    T = len(att)
    want = {
        "self": sum(att[r][r] for r in range(1, T)) / (T - 1),
        "previous": sum(att[r][r - 1] for r in range(1, T)) / (T - 1),
        "first": sum(att[r][0] for r in range(1, T)) / (T - 1),
    }
    got = page.eval_on_selector("#caption .head-stats", "e => ({self: +e.dataset.self, previous: +e.dataset.previous, first: +e.dataset.first})")
    for k in want:
        assert got[k] == pytest.approx(want[k], abs=1e-4), (k, got, want)
    assert "query rows 1" in page.inner_text("#caption")


def test_aggregate_legends_say_what_they_show(page, server):
    open_page(page, server, view="aggregate")
    assert page.eval_on_selector_all("#op option", "os => os.map(o => o.value)") == ["mean", "max", "rollout"]
    labels = {}
    for op in ("mean", "max", "rollout"):
        r = rendered(page)
        page.select_option("#op", op)
        if op != "mean":
            wait_rendered(page, r)
        labels[op] = page.inner_text("#legend-label")
    assert "mean attention weight" in labels["mean"]
    assert "largest attention weight" in labels["max"]
    assert "rolled-out" in labels["rollout"]
    # an old link asking for "sum" gets the mean, not a relabelled copy of it
    open_page(page, server, view="aggregate", op="sum")
    assert state(page, "s.op") == "mean"


def test_two_prompt_difference_shows_both_token_axes_and_a_multiline_b(page, server):
    open_page(page, server, view="diff")
    b_text = "The slings and arrows\nof outrageous fortune"
    r = rendered(page)
    page.check('input[name="diff"][value="prompts"]')
    wait_rendered(page, r)
    r = rendered(page)
    page.fill("#promptB", b_text)
    page.click("#compare")
    wait_rendered(page, r)
    assert state(page, "s.promptB") == b_text
    assert urllib.parse.quote(b_text.split("\n")[0].split(" ")[-1]) in page.url and "%0A" in page.url
    b_tokens = [t["text"] for t in api_attention(server, text=b_text)["tokens"]]
    model = page.evaluate("() => { const m = window.__attnlens.current().heatmap.model; return {rows: m.rows, r2: m.rowLabels2, c2: m.colLabels2, r1: m.rowLabels}; }")
    n = model["rows"]
    assert model["r2"] == b_tokens[:n] and model["c2"] == b_tokens[:n]
    assert model["r1"] != model["r2"]
    p = page.evaluate("() => window.__attnlens.current().heatmap.cellCenter(3, 1)")
    page.mouse.move(p["x"], p["y"])
    page.wait_for_selector("#tooltip:not([hidden])")
    assert "in B:" in page.inner_text("#tooltip")
    assert "A (text A) attends more" in page.inner_text("#caption")


def test_head_view_marks_where_the_prompt_ends(page, server):
    open_page(page, server)
    prompt = "To be, or not"
    page.fill("#prompt", prompt)
    gen_ids = [t["id"] for t in api_attention(server, text=" to be, that")["tokens"]]
    r = rendered(page)
    generate_with(page, generation_events(server, prompt, gen_ids))
    wait_rendered(page, r, prefix="head:")
    P = len(api_attention(server, text=prompt)["tokens"])
    hm = "window.__attnlens.current().heatmap"
    assert page.evaluate(f"() => {hm}.model.boundary") == P
    # the line is drawn: the pixel on it, halfway down the grid, has the boundary colour
    px = page.evaluate(f"""() => {{
        const h = {hm}, L = h.layout, dpr = window.devicePixelRatio || 1;
        const x = Math.round((L.left + {P} * L.cellW) * dpr), y = Math.round((L.top + L.gridH * 0.75) * dpr);
        return Array.from(h.base.getContext('2d').getImageData(x, y, 1, 1).data);
    }}""")
    assert abs(px[0] - 0xD9) < 30 and abs(px[1] - 0x48) < 30 and abs(px[2] - 0x0F) < 30, px
    assert "prompt ends" in page.inner_text("#caption")
    # a typed prompt analysed as text has no boundary
    r = rendered(page)
    page.click("#analyse")
    wait_rendered(page, r)
    assert page.evaluate(f"() => {hm}.model.boundary") is None
