"""Issue 18's page against a real `attnlens serve` of the three bundled models: the head atlas
(every group of the decoder, the encoder and the translator, the probe, hover and keyboard focus,
a click opens the head), the logit lens, ablation (chosen in the atlas and the Model view, carried
by the link, its effect per token and on a generation from the same seed) and the Head view's
explain panel, at desktop and phone widths. Every number on the page is checked against the
API's own answer for the same input."""

from __future__ import annotations

import urllib.parse

import httpx
import pytest

from .helpers import download, rendered, screenshot, spill, state, wait_rendered

PROMPT = "To be, or not to be, that is the question:\nWhether"
SOURCE = "Wednesday, March 3, 2021"


def api(server, path: str, body: dict) -> dict:
    r = httpx.post(f"{server.base_url}{path}", json=body, timeout=120)
    r.raise_for_status()
    return r.json()


def need(server, *paths: str, generate_ablate: bool = False) -> None:
    """Skip when the server lacks a route this test drives (the backend branches land separately)."""
    spec = httpx.get(f"{server.base_url}/openapi.json", timeout=30).json()
    missing = [p for p in paths if p not in spec["paths"]]
    if generate_ablate and "ablate" not in str(spec["components"]["schemas"].get("GenerateRequest", {})):
        missing.append("POST /generate with ablate")
    if missing:
        pytest.skip(f"the server does not have {missing} yet")


def analyse(page, server, text: str, model: str = "default", **query) -> None:
    """Open the page on `model`, type `text`, press Analyse and wait for the picture."""
    q = urllib.parse.urlencode({"model": model, **query})
    page.goto(f"{server.base_url}/?{q}")
    page.wait_for_function(f"() => window.__attnlens.store.state.meta?.name === '{model}'")
    r = wait_rendered(page)
    page.fill("#prompt", text)
    page.click("#analyse")
    page.wait_for_function("(t) => window.__attnlens.store.state.att?.text === t && window.__attnlens.store.state.att?.T > 0", arg=text)
    wait_rendered(page, r)


def open_tab(page, view: str) -> None:
    if state(page, "s.view") == view:
        return
    r = rendered(page)
    page.click(f"#tab-{view}")
    wait_rendered(page, r, prefix=f"{view}:")


def fits(page, width: int, what: str) -> None:
    s = spill(page)
    assert s["scrollWidth"] <= width and not s["wide"], (what, s)


def cells(page, group: str | None = None) -> list[dict]:
    sel = ".atlas-cell" + (f'[data-group="{group}"]' if group else "")
    return page.eval_on_selector_all(sel, "bs => bs.map(b => ({layer: +b.dataset.layer, head: +b.dataset.head, group: b.dataset.group, role: b.dataset.role}))")


# --- the atlas ------------------------------------------------------------------------------------
def test_atlas_colours_every_head_by_its_role_and_opens_it(page, bundled_server):
    need(bundled_server, "/heads")
    analyse(page, bundled_server, PROMPT)
    open_tab(page, "atlas")
    want = api(bundled_server, "/heads", {"text": PROMPT})
    shown = cells(page)
    assert len(shown) == 4 * 8
    assert [c["role"] for c in shown] == [h["role"] for row in want["heads"] for h in row]
    # every role on screen is in the legend, with its threshold
    legend = page.inner_text(".atlas-legend")
    for role, threshold in want["thresholds"].items():
        assert f"{role.replace('_', ' ')} ≥ {threshold:.2f}" in legend
    # hover: the scores of that head
    cell = page.locator('.atlas-cell[data-layer="2"][data-head="2"]')
    cell.hover()
    tip = page.inner_text("#tooltip")
    scores = want["heads"][2][2]["scores"]
    assert "layer 2 · head 2" in tip and f"{scores['previous_token']:.2f}" in tip
    # keyboard: focus shows the same
    page.mouse.move(0, 0)
    page.locator('.atlas-cell[data-layer="1"][data-head="3"]').focus()
    assert "layer 1 · head 3" in page.inner_text("#tooltip")
    # PNG: the grids with role names; JSON: the answer
    path, name = download(page, "#export-png")
    assert name == "attnlens-atlas.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    path, name = download(page, "#export-json")
    assert name == "attnlens-atlas.json" and '"thresholds"' in path.read_text()
    # a click opens the head in the Head view
    r = rendered(page)
    cell.click()
    wait_rendered(page, r, prefix="head:2:2:")
    assert state(page, "[s.view, s.layer, s.head]") == ["head", 2, 2]
    assert "Layer 2 · head 2" in page.inner_text("#caption")


def test_the_probe_scores_repeated_random_tokens(page, bundled_server):
    need(bundled_server, "/heads")
    analyse(page, bundled_server, PROMPT)
    open_tab(page, "atlas")
    bodies = []
    page.on("request", lambda q: bodies.append(q.post_data_json) if q.url.endswith("/heads") else None)
    r = rendered(page)
    page.get_by_role("radio", name="Probe: repeated random tokens").click()
    wait_rendered(page, r, prefix="atlas:")
    assert bodies and bodies[-1]["probe"] == {"kind": "repeated_random", "length": 50, "seed": 0}
    assert state(page, "s.probe") is True and "probe=1" in page.url
    assert "repeated-random probe (50 random tokens twice, seed 0)" in page.inner_text("#caption")
    want = api(bundled_server, "/heads", {"probe": {"kind": "repeated_random", "length": 50, "seed": 0}})
    assert [c["role"] for c in cells(page)] == [h["role"] for row in want["heads"] for h in row]
    # the link brings the probe back
    page.reload()
    page.wait_for_function("() => window.__attnlens.store.state.meta")
    wait_rendered(page, prefix="atlas:")
    assert "repeated-random probe" in page.inner_text("#caption")


def test_atlas_of_the_encoder_and_of_the_translators_three_groups(page, bundled_server):
    need(bundled_server, "/heads")
    analyse(page, bundled_server, SOURCE, model="translator")
    open_tab(page, "atlas")
    want = api(bundled_server, "/heads", {"model": "translator", "text": SOURCE})
    assert [g["name"] for g in want["groups"]] == ["encoder", "decoder", "cross"]
    for g in want["groups"]:
        assert [c["role"] for c in cells(page, g["name"])] == [h["role"] for row in g["heads"] for h in row], g["name"]
    assert page.locator(".atlas-group h3").count() == 3
    # a cross head opens in the Cross view; a decoder head in the Decoder view
    r = rendered(page)
    page.click('.atlas-cell[data-group="cross"][data-layer="1"][data-head="2"]')
    wait_rendered(page, r, prefix="cross:1:2:")
    assert state(page, "[s.view, s.layer, s.head, s.xavg]") == ["cross", 1, 2, "head"]
    open_tab(page, "atlas")
    r = rendered(page)
    page.click('.atlas-cell[data-group="decoder"][data-layer="2"][data-head="0"]')
    wait_rendered(page, r, prefix="decoder:2:0:")
    screenshot(page, "explain-atlas-translator.png")

    analyse(page, bundled_server, PROMPT, model="encoder")
    open_tab(page, "atlas")
    want = api(bundled_server, "/heads", {"model": "encoder", "text": PROMPT})
    assert [c["role"] for c in cells(page)] == [h["role"] for row in want["heads"] for h in row]
    page.click(".atlas-notes summary")
    assert "next token" in page.inner_text(".atlas-notes")  # the bidirectional analogue it names


def test_the_atlas_ranks_the_heads_by_any_score_clarks_among_them(page, bundled_server):
    need(bundled_server, "/heads")
    analyse(page, bundled_server, PROMPT, model="encoder")
    open_tab(page, "atlas")
    want = api(bundled_server, "/heads", {"model": "encoder", "text": PROMPT})
    if not want.get("clark_sentences"):
        pytest.skip("the server does not give Clark et al.'s scores yet")
    heads = [h for row in want["heads"] for h in row]
    assert "attends to [SEP] ≥ 0.50" in page.inner_text(".atlas-legend")
    page.click(".atlas-rank summary")
    page.wait_for_selector(".atlas-sort")  # the table is drawn when the panel opens (its toggle event)
    headers = page.eval_on_selector_all(".atlas-sort", "bs => bs.map(b => b.dataset.sort)")
    assert headers == ["head", "role", "role_score", *want["heads"][0][0]["scores"]]
    for name in ("clark_cls", "clark_sep", "clark_punctuation", "clark_previous", "clark_next", "clark_entropy"):
        assert name in headers
    text = page.inner_text(".atlas-table thead")
    assert "Clark: to [SEP]" in text and "Clark: entropy (nats)" in text
    order = lambda: page.eval_on_selector_all(".atlas-table tbody tr", "rs => rs.map(r => [+r.dataset.layer, +r.dataset.head])")
    assert order() == [[h["layer"], h["head"]] for h in heads]  # layer and head order at first
    for name in ("clark_sep", "clark_entropy", "previous_token"):
        page.click(f'.atlas-sort[data-sort="{name}"]')  # highest first
        by = sorted(heads, key=lambda h: (-h["scores"][name], h["layer"], h["head"]))
        assert order() == [[h["layer"], h["head"]] for h in by], name
        assert page.get_attribute(f'.atlas-table th:has(.atlas-sort[data-sort="{name}"])', "aria-sort") == "descending"
        shown = page.eval_on_selector_all(f'.atlas-table tbody td[data-score="{name}"]', "ds => ds.map(d => d.textContent)")
        assert shown[0] == f"{by[0]['scores'][name]:.2f}"
    page.click('.atlas-sort[data-sort="previous_token"]')  # again: lowest first
    by = sorted(heads, key=lambda h: (h["scores"]["previous_token"], h["layer"], h["head"]))
    assert order() == [[h["layer"], h["head"]] for h in by]
    screenshot(page, "explain-atlas-ranked.png")
    # the definitions name Clark's sentences; a head's row opens it
    page.click(".atlas-notes summary")
    assert want["clark_sentences"][0] in page.inner_text(".atlas-notes")
    first = by[0]
    r = rendered(page)
    page.click(f'.atlas-table tr[data-layer="{first["layer"]}"][data-head="{first["head"]}"] .atlas-open')
    wait_rendered(page, r, prefix=f"head:{first['layer']}:{first['head']}:")
    assert not page.console_log.errors


# --- the logit lens -------------------------------------------------------------------------------
@pytest.mark.parametrize("model, text", [("default", PROMPT), ("encoder", PROMPT), ("translator", SOURCE)])
def test_lens_grid_shows_each_layers_top_token_and_marks_the_actual_one(page, bundled_server, model, text):
    need(bundled_server, "/lens")
    analyse(page, bundled_server, text, model=model)
    open_tab(page, "lens")
    body = {"model": model, "text": text, "top_k": 5, "rank": True}
    want = api(bundled_server, "/lens", body)
    for layer in want["layers"]:  # the encoder's 18 positions ([CLS] text [SEP]): the page reads the last 16
        layer["positions"] = layer["positions"][-16:]
    grid = page.eval_on_selector_all(".lens-grid tbody tr", "trs => trs.map(tr => [...tr.querySelectorAll('td')].map(td => ({hit: td.classList.contains('hit'), p: +td.style.getPropertyValue('--p')})))")
    assert len(grid) == len(want["layers"])
    for row, layer in zip(grid, want["layers"]):
        assert len(row) == len(layer["positions"])
        for cell, pos in zip(row, layer["positions"]):
            assert cell["p"] == pytest.approx(pos["top"][0]["prob"], abs=1e-6)
            assert cell["hit"] == bool(pos["actual"] and pos["actual"]["id"] == pos["top"][0]["id"])
    assert page.locator(".lens-grid tbody th").all_inner_texts() == [layer["label"] for layer in want["layers"]]
    path, name = download(page, "#export-png")
    assert name == "attnlens-lens.png" and path.stat().st_size > 1000
    # hover: the top 5 and the actual token's rank
    page.locator(".lens-grid td[data-layer='1'][data-pos='2']").hover()  # the window's third column
    tip = page.inner_text("#tooltip")
    pos = want["layers"][1]["positions"][2]
    assert all(t["text"].strip() in tip for t in pos["top"])
    if pos["actual"]:
        assert f"rank {pos['actual']['rank']}" in tip


def test_lens_on_a_long_prompt_reads_a_window_of_positions_and_moves_it(page, bundled_server):
    """A prompt longer than the window: the page asks /lens for the last 16 positions only, labels
    the columns with their positions, and the window's buttons move it (a link keeps it)."""
    need(bundled_server, "/lens")
    text = " ".join([PROMPT] * 3)
    T = len(api(bundled_server, "/attention", {"text": text, "format": "json"})["tokens"])
    assert T > 32
    analyse(page, bundled_server, text)
    open_tab(page, "lens")

    def shown():
        return page.eval_on_selector_all(".lens-grid thead th[scope=col]", "ths => ths.map(th => th.title)")

    def window_of(start):
        want = api(bundled_server, "/lens", {"text": text, "top_k": 5, "rank": True,
                                              "positions": list(range(start, start + 16))})
        grid = page.eval_on_selector_all(".lens-grid tbody tr", "trs => trs.map(tr => [...tr.querySelectorAll('td')].map(td => +td.style.getPropertyValue('--p')))")
        assert [row for row in grid] == [[pytest.approx(p["top"][0]["prob"], abs=1e-6) for p in layer["positions"]]
                                          for layer in want["layers"]]
        assert [t.split(" ")[0] for t in shown()] == [f"#{i}" for i in range(start, start + 16)]
        assert page.inner_text(".lens-window span") == f"positions {start}–{start + 15} of {T}"

    window_of(T - 16)
    assert page.is_disabled(".lens-window button:has-text('later')")
    r = rendered(page)
    page.click(".lens-window button:has-text('earlier')")
    wait_rendered(page, r, prefix="lens:")
    window_of(T - 32)
    assert f"lensat={T - 32}" in page.url
    r = rendered(page)
    page.click(".lens-window button:has-text('first')")
    wait_rendered(page, r, prefix="lens:")
    window_of(0)
    assert page.is_disabled(".lens-window button:has-text('earlier')")


# --- ablation -------------------------------------------------------------------------------------
def test_ablation_chosen_in_the_atlas_runs_and_the_link_carries_it(page, bundled_server):
    need(bundled_server, "/heads", "/logits", generate_ablate=True)
    analyse(page, bundled_server, PROMPT)
    page.fill("#max_new_tokens", "12")
    page.fill("#seed", "7")
    page.dispatch_event("#seed", "change")
    open_tab(page, "atlas")
    page.click('.atlas-cell[data-layer="2"][data-head="2"]', modifiers=["Alt"])
    page.get_by_role("button", name="Choose heads to ablate").click()
    page.click('.atlas-cell[data-layer="0"][data-head="5"]')
    assert state(page, "s.ablate") == "2.2z,0.5z"
    assert page.locator(".atlas-cell.ablated").count() == 2
    assert "ablate=2.2z%2C0.5z" in page.url
    open_tab(page, "ablate")
    page.wait_for_selector(".ablate[data-state=done]")
    ablate = [{"layer": 2, "head": 2, "how": "zero", "group": None}, {"layer": 0, "head": 5, "how": "zero", "group": None}]
    want = api(bundled_server, "/logits", {"text": PROMPT, "top_k": 5, "positions": "all", "ablate": ablate})
    deltas = page.eval_on_selector_all(".abl-tok", "ts => ts.map(t => t.dataset.delta === '' ? null : +t.dataset.delta)")
    assert deltas == pytest.approx([e["delta_logprob"] for e in want["effect"] if e["delta_logprob"] is not None], abs=1e-6)
    kls = [e["kl"] for e in want["effect"] if e["kl"] is not None]
    assert page.inner_text("[data-kl]") == f"{sum(kls) / len(kls):.4f}"
    # the two generations: the same request with and without `ablate`, seed 7
    texts = page.eval_on_selector_all(".abl-text", "ps => ps.map(p => p.textContent)")
    gen = {"prompt": PROMPT, "max_new_tokens": 12, "temperature": 0.8, "top_p": 1, "seed": 7, "stream": False}
    clean = api(bundled_server, "/generate", gen)["text"]
    ablated = api(bundled_server, "/generate", {**gen, "ablate": ablate})["text"]
    assert texts == [clean, ablated]
    marked = page.locator(".abl-text del, .abl-text ins").count()
    assert (marked > 0) == (clean != ablated)
    # a head's "how" changes the link; the link restores the ablation
    page.select_option('.abl-chip[data-head="0.5z"] select', "mean")
    assert state(page, "s.ablate") == "2.2z,0.5m"
    url = page.url
    page.goto("about:blank")
    page.goto(url)
    wait_rendered(page, prefix="ablate:")
    page.wait_for_selector(".ablate[data-state=done]")
    assert page.locator(".abl-chip").all_inner_texts()[0].startswith("L2 H2")
    assert page.locator(".abl-chip select").evaluate_all("ss => ss.map(s => s.value)") == ["zero", "mean"]
    screenshot(page, "explain-ablate.png")


def test_model_view_shift_click_toggles_a_heads_ablation(page, bundled_server):
    analyse(page, bundled_server, PROMPT)
    open_tab(page, "model")
    page.click('.thumb[data-layer="1"][data-head="3"]', modifiers=["Shift"])
    page.wait_for_function("() => window.__attnlens.store.state.ablate === '1.3z'")
    assert page.locator(".thumb.ablated").count() == 1 and state(page, "s.view") == "model"
    page.click('.thumb[data-layer="1"][data-head="3"]', modifiers=["Shift"])
    page.wait_for_function("() => window.__attnlens.store.state.ablate === ''")
    assert page.locator(".thumb.ablated").count() == 0


def test_encoder_ablation_changes_its_masked_lm_predictions(page, bundled_server):
    need(bundled_server, "/logits")
    analyse(page, bundled_server, PROMPT, model="encoder", ablate="0.1m")
    open_tab(page, "ablate")
    page.wait_for_selector(".ablate[data-state=done]")
    assert page.locator(".abl-gens").inner_text() == ""  # an encoder does not generate
    want = api(bundled_server, "/logits", {"model": "encoder", "text": PROMPT, "top_k": 5, "positions": "all",
                                           "ablate": [{"layer": 0, "head": 1, "how": "mean", "group": None}]})
    deltas = page.eval_on_selector_all(".abl-tok", "ts => ts.map(t => t.dataset.delta === '' ? null : +t.dataset.delta)")
    assert deltas == pytest.approx([e["delta_logprob"] for e in want["effect"]], abs=1e-6)
    assert "the token at each position" in page.inner_text(".abl-effect h3")


def test_translator_ablation_names_its_group(page, bundled_server):
    need(bundled_server, "/heads", "/logits")
    analyse(page, bundled_server, SOURCE, model="translator", view="atlas", ablate="1.2z")
    assert state(page, "s.ablate") == "decoder:1.2z"  # no group: the family's first generating group, written out
    open_tab(page, "atlas")
    page.click('.atlas-cell[data-group="cross"][data-layer="0"][data-head="1"]', modifiers=["Shift"])
    assert state(page, "s.ablate") == "decoder:1.2z,cross:0.1z"
    assert page.locator('.atlas-cell.ablated[data-group="decoder"]').count() == 1
    open_tab(page, "ablate")
    page.wait_for_selector(".ablate[data-state=done]")
    want = api(bundled_server, "/logits", {"model": "translator", "text": SOURCE, "top_k": 5, "positions": "all",
                                           "ablate": [{"layer": 1, "head": 2, "how": "zero", "group": "decoder"},
                                                      {"layer": 0, "head": 1, "how": "zero", "group": "cross"}]})
    deltas = page.eval_on_selector_all(".abl-tok", "ts => ts.map(t => t.dataset.delta === '' ? null : +t.dataset.delta)")
    assert deltas == pytest.approx([e["delta_logprob"] for e in want["effect"] if e["delta_logprob"] is not None], abs=1e-6)


# --- explain ----------------------------------------------------------------------------------------
def test_clicking_a_heatmap_cell_explains_its_row_step_by_step(page, bundled_server):
    need(bundled_server, "/attention/explain")
    analyse(page, bundled_server, PROMPT, layer=2, head=2)
    T = state(page, "s.att.T")
    # click the cell of query row 8, key 5
    page.evaluate("() => window.__attnlens.current().heatmap.overlay.scrollIntoView()")
    box = page.evaluate("""() => { const hm = window.__attnlens.current().heatmap; const L = hm.layout;
        const r = hm.overlay.getBoundingClientRect();
        return {x: r.left + L.left + (5 + 0.5) * L.cellW, y: r.top + L.top + (8 + 0.5) * L.cellH}; }""")
    page.mouse.click(box["x"], box["y"])
    page.wait_for_selector("#explain-panel[data-state=done]")
    assert state(page, "[s.explain, s.pin]") == [8, [8]] and "explain=8" in page.url
    want = api(bundled_server, "/attention/explain", {"text": PROMPT, "layer": 2, "head": 2, "query": 8})
    rows = page.eval_on_selector_all(".xp-table tbody tr", "trs => trs.map(tr => [...tr.cells].map(c => c.textContent))")
    assert len(rows) == T == len(want["key_tokens"])
    for i, row in enumerate(rows):
        assert float(row[2]) == pytest.approx(want["scores"][i], abs=1e-3)
        assert float(row[3]) == pytest.approx(want["scaled"][i], abs=1e-3)
        assert row[4] == ("✓" if want["mask"][i] else "−∞")
        assert float(row[5]) == pytest.approx(want["softmax"][i], abs=1e-4)
    assert page.locator(".xp-table tbody tr.hl td").first.inner_text() == "5"
    assert page.inner_text("[data-scale]") == f"{want['scale']:.5f}"
    assert "softmax(QKᵀ/√d)V" in page.inner_text("#explain-panel")
    assert page.locator("#explain-panel svg rect").count() == 2 * T
    # the softmax column is the map's row on the page
    drawn = page.evaluate(f"() => Array.from(window.__attnlens.current().result.data.subarray(8 * {T}, 9 * {T}))")
    assert [float(r[5]) for r in rows[:9]] == pytest.approx(drawn[:9], abs=1e-3)
    # the link reopens it; the close button closes it
    page.reload()
    page.wait_for_selector("#explain-panel[data-state=done]")
    page.click(".xp-close")
    page.wait_for_function("() => window.__attnlens.store.state.explain === null")
    assert page.locator("#explain-panel").is_hidden()
    # from the keyboard: Enter on the focused map explains its row, Escape closes it
    page.focus("#view-host .heatmap-overlay")
    page.keyboard.press("ArrowDown")
    page.keyboard.press("Enter")
    page.wait_for_selector("#explain-panel[data-state=done]")
    page.keyboard.press("Escape")
    page.wait_for_function("() => window.__attnlens.store.state.explain === null")


def test_the_translators_cross_and_decoder_maps_explain_their_rows(page, bundled_server):
    need(bundled_server, "/attention/explain")
    analyse(page, bundled_server, SOURCE, model="translator", view="cross", layer=1, head=2)
    m = page.evaluate("() => { const r = window.__attnlens.current().result; return {rows: r.rows, cols: r.cols}; }")
    page.evaluate("() => window.__attnlens.current().heatmap.overlay.scrollIntoView()")
    box = page.evaluate("""() => { const hm = window.__attnlens.current().heatmap; const L = hm.layout;
        const r = hm.overlay.getBoundingClientRect();
        return {x: r.left + L.left + 0.5 * L.cellW, y: r.top + L.top + 2.5 * L.cellH}; }""")
    page.mouse.click(box["x"], box["y"])
    page.wait_for_selector("#explain-panel[data-state=done]")
    want = api(bundled_server, "/attention/explain", {"model": "translator", "text": SOURCE, "group": "cross", "layer": 1, "head": 2, "query": 2})
    assert "(cross)" in page.inner_text("#explain-panel h3")
    rows = page.eval_on_selector_all(".xp-table tbody tr", "trs => trs.map(tr => +tr.cells[5].textContent)")
    assert len(rows) == m["cols"] and rows == pytest.approx(want["softmax"], abs=1e-4)
    drawn = page.evaluate(f"() => Array.from(window.__attnlens.current().result.data.subarray(2 * {m['cols']}, 3 * {m['cols']}))")
    assert rows == pytest.approx(drawn, abs=1e-3)
    # a layer's mean is no one head's map: nothing to explain
    r = rendered(page)
    page.select_option("#xavg", "layer")
    wait_rendered(page, r)
    assert page.locator("#explain-panel").is_hidden()
    page.select_option("#xavg", "head")
    open_tab(page, "decoder")
    page.wait_for_selector("#explain-panel[data-state=done]")
    assert "(decoder)" in page.inner_text("#explain-panel h3")
    want = api(bundled_server, "/attention/explain", {"model": "translator", "text": SOURCE, "group": "decoder", "layer": 1, "head": 2, "query": 2})
    rows = page.eval_on_selector_all(".xp-table tbody tr", "trs => trs.map(tr => +tr.cells[5].textContent)")
    assert rows == pytest.approx(want["softmax"], abs=1e-4)


# --- widths -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("width", [390, 768, 1280])
def test_the_new_views_fit_the_width(browser, bundled_server, width):
    need(bundled_server, "/heads", "/lens", "/logits", "/attention/explain")
    phone = width < 500
    context = browser.new_context(viewport={"width": width, "height": 844}, is_mobile=phone, has_touch=phone,
                                  device_scale_factor=2 if phone else 1, color_scheme="light")
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.set_default_timeout(30_000)
    try:
        for model, text in (("default", PROMPT), ("translator", SOURCE)):
            analyse(page, bundled_server, text, model=model, ablate="1.1z")
            for view in ("atlas", "lens", "ablate"):
                open_tab(page, view)
                if view == "ablate":
                    page.wait_for_selector(".ablate[data-state=done]")
                fits(page, width, (model, view))
                screenshot(page, f"explain-{model}-{view}-{width}.png")
            open_tab(page, "head")
            page.evaluate("() => window.__attnlens.store.set({explain: 3})")
            page.wait_for_selector("#explain-panel[data-state=done]")
            fits(page, width, (model, "explain"))
        assert not errors, errors
    finally:
        context.close()


def test_the_difference_view_shows_a_heads_map_without_and_with_the_ablation(page, bundled_server):
    """Difference view, "Ablation": the chosen head's clean map minus its map with the ablated heads
    (POST /attention with ablate); a head the ablation cannot reach shows no change."""
    analyse(page, bundled_server, PROMPT, view="ablate", ablate="1.0z,2.5m", layer=3, head=1)
    r = rendered(page)
    page.click(".abl-maps")  # the Ablate view's "Compare maps" opens it
    wait_rendered(page, r, prefix="diff:")
    assert page.is_checked('input[name="diff"][value="ablation"]') and "diff=ablation" in page.url
    assert page.inner_text("#diff-ablation") == "L1 H0 zero, L2 H5 mean"
    ablate = [{"layer": 1, "head": 0, "how": "zero"}, {"layer": 2, "head": 5, "how": "mean"}]

    def maps(layer: int, head: int, **extra) -> list[list[float]]:
        a = api(bundled_server, "/attention", {"text": PROMPT, "layers": [layer], "heads": [head], **extra})
        return a["attention"][0][0]

    clean, ablated = maps(3, 1), maps(3, 1, ablate=ablate)
    T = len(clean)
    drawn = page.evaluate("() => Array.from(window.__attnlens.current().result.data)")
    want = [c - a for rc, ra in zip(clean, ablated) for c, a in zip(rc, ra)]
    assert len(drawn) == T * T and drawn == pytest.approx(want, abs=1e-5)
    assert max(abs(v) for v in want) > 1e-3  # the ablation reaches layer 3
    assert "without (A) and with (B) L1 H0 zero, L2 H5 mean ablated" in page.inner_text("#caption")
    # layer 1 reads the residual stream before any ablated head writes to it: no change
    r = rendered(page)
    page.select_option("#layer", "1")
    wait_rendered(page, r)
    got = page.evaluate("() => Array.from(window.__attnlens.current().result.data)")
    bad = [v for v in got if v == v and abs(v) > 1e-5]  # float32 rounding: the two maps may come from different kernels
    assert not bad, (len(got), bad[:20], page.url, page.inner_text("#caption"))
    assert "nothing changed" in page.inner_text("#caption")
    # without an ablation the view says how to choose one, and draws nothing stale
    r = rendered(page)
    page.evaluate("() => window.__attnlens.store.set({ ablate: '' })")
    wait_rendered(page, r)
    assert "Choose heads to ablate" in page.inner_text("#caption") and "ablate=" not in page.url
