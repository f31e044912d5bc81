"""The Causes view (issue 46) in Chromium against the tiny model's real server, with the causal
routes (POST /patch, /logit-attribution) answered by causes_fixtures (they are built on another
branch): both prompts typed, the answer and foil picked from the clean prompt's real top
predictions (POST /logits), the layers x heads map painted with its legend, a head clicked (its
attention on both prompts, its direct logit attribution and its paths), the state carried by the
URL through a reload, the phone width, and the draw time at SmolLM2's 270 heads."""

from __future__ import annotations

import json

from .causes_fixtures import CLEAN_METRIC, CORRUPTED_METRIC, head_pattern, install, tokens
from .conftest import PHONE
from .helpers import canvas_digest, download, open_page, rendered, screenshot, spill, state, wait_rendered

CLEAN = "To be, or not to be, that is the question:\nWhether"
CORRUPTED = "To be, or not to sleep, that is the question:\nWhether"  # the same 30 tokens but one


CLICK_TO_RENDERED = """() => {
    document.addEventListener('click', () => { window.__clickAt = performance.now(); }, true);
    new MutationObserver(() => { window.__renderedAt = performance.now(); })
        .observe(document.querySelector('#view-host'), {attributes: true, attributeFilter: ['data-rendered']});
}"""


def open_causes(page, server) -> None:
    open_page(page, server, prompt=CLEAN)
    r = rendered(page)
    page.click("#tab-causes")
    wait_rendered(page, r, prefix="causes:")


def patch(page, clean: str = CLEAN, corrupted: str = CORRUPTED) -> None:
    """Type both prompts and press Patch."""
    page.fill("#cz-clean", clean)
    page.fill("#cz-corrupted", corrupted)
    r = rendered(page)
    page.click(".cz-run")
    wait_rendered(page, r, prefix="causes:")


def pick(page, name: str, index: int) -> str:
    """Choose the `index`-th top prediction as the answer or foil; returns its text."""
    value = page.eval_on_selector(f"#cz-{name}", "(s, i) => s.options[i].value", index)
    r = rendered(page)
    page.select_option(f"#cz-{name}", index=index)
    wait_rendered(page, r, prefix="causes:")
    return value


def click_head(page, layer: int, head: int) -> None:
    page.locator(".cz-maps .heatmap-overlay").first.scroll_into_view_if_needed()
    xy = page.evaluate("([l, h]) => window.__attnlens.current().maps[0].cellCenter(l, h)", [layer, head])
    r = rendered(page)
    page.mouse.click(xy["x"], xy["y"])
    wait_rendered(page, r, prefix=f"causes:{layer}:{head}:")
    page.wait_for_selector('.cz-detail[data-state="done"]')


def test_types_both_prompts_picks_answer_and_foil_and_draws_the_heads(page, server):
    routes = install(page, server)
    L, H = routes.L, routes.H
    open_causes(page, server)
    # prefilled: the clean prompt is the analysed text, the corrupted one starts from it
    assert page.input_value("#cz-clean") == CLEAN and page.input_value("#cz-corrupted") == CLEAN
    assert not page.is_visible("#cz-target")  # a decoder has no target (the translator's field)
    assert not routes.patch_bodies  # nothing to patch while the prompts are the same
    _, top = tokens(server, CLEAN)
    # the choices are the clean prompt's top predictions, the first two chosen by default
    options = page.eval_on_selector("#cz-answer", "s => [...s.options].map(o => o.value)")
    assert options == [t["text"] for t in top]
    assert page.input_value("#cz-answer") == top[0]["text"] and page.input_value("#cz-foil") == top[1]["text"]
    # type the corrupted prompt, then pick: the choice applies the prompts as typed
    page.fill("#cz-clean", CLEAN)
    page.fill("#cz-corrupted", CORRUPTED)
    answer = pick(page, "answer", 2)
    assert routes.patch_bodies[-1]["corrupted"] == CORRUPTED and routes.patch_bodies[-1]["foil_id"] == top[1]["id"]
    foil = pick(page, "foil", 3)
    body = routes.patch_bodies[-1]
    assert body == {"clean": CLEAN, "corrupted": CORRUPTED, "answer_id": top[2]["id"], "foil_id": top[3]["id"], "component": "heads", "method": "exact"}
    assert routes.attribution_bodies[-1] == {"text": CLEAN, "answer_id": top[2]["id"], "foil_id": top[3]["id"]}
    assert state(page, "[s.answer, s.foil]") == [answer, foil]
    # the differing token is marked on both sides
    assert page.eval_on_selector_all(".cz-tokens[data-side=clean] mark.diff", "ms => ms.map(m => +m.dataset.pos)") == [8]
    assert page.inner_text(".cz-tokens[data-side=corrupted] mark.diff") == "␣sleep"
    # the map: layers x heads, painted in the diverging map, with the legend
    hm = page.evaluate("() => { const m = window.__attnlens.current().maps[0].model; return [m.rows, m.cols, m.vmin, m.vmax, m.cmap]; }")
    assert hm == [L, H, -1, 1, "RdBu"]
    d = canvas_digest(page, ".cz-maps .heatmap-base")
    assert d["nonBlank"] > 0 and d["colours"] > 8, d
    assert page.is_visible("#legend-wrap") and "normalised effect" in page.inner_text("#legend-label")
    assert canvas_digest(page, "#legend")["colours"] > 20
    assert f"clean {CLEAN_METRIC:.3f}" in page.inner_text(".cz-metrics") and f"corrupted {CORRUPTED_METRIC:.3f}" in page.inner_text(".cz-metrics")
    # the normalised values drawn are the fixture's
    want = head_pattern(L, H)
    got = page.evaluate("() => Array.from(window.__attnlens.current().maps[0].model.data)")
    assert all(abs(g - w) < 1e-4 for g, w in zip(got, [x for row in want for x in row]))
    # the attribution chart: the largest heads and MLPs first
    names = page.eval_on_selector_all(".cz-bar-row .cz-bar-name", "bs => bs.map(b => b.textContent)")
    assert len(names) == min(12, L * H + L) and names[0] == f"L{L - 1} H{1 % H}"
    # a head clicked: its maps on both prompts, its values, its paths
    click_head(page, L - 1, 1 % H)
    assert state(page, "s.sender") == [L - 1, 1 % H]
    assert page.inner_text(".cz-detail h3") == f"Layer {L - 1}, head {1 % H}"
    assert page.inner_text(".cz-detail [data-effect]") == "0.920"
    assert page.inner_text(".cz-detail [data-dla]") == "+2.760"
    for side in ("clean", "corrupted"):
        c = canvas_digest(page, f'.cz-att figure[data-side="{side}"] .heatmap-base')
        assert c.get("colours", 0) > 8, (side, c)
    assert routes.patch_bodies[-1]["component"] == "paths" and routes.patch_bodies[-1]["sender"] == {"layer": L - 1, "head": 1 % H}
    assert "No head reads this one" in page.inner_text(".cz-paths")  # the last layer's head: no later reader
    # a bar's head opens it too: a layer-0 head, whose paths reach the next layer
    r = rendered(page)
    page.click(f'.cz-attr button[data-layer="0"][data-head="{H - 1}"]')
    wait_rendered(page, r, prefix=f"causes:0:{H - 1}:")
    page.wait_for_selector(f'.cz-detail[data-head="0.{H - 1}"][data-state="done"]')
    assert page.get_attribute(f'.cz-attr button[data-layer="0"][data-head="{H - 1}"]', "aria-pressed") == "true"
    assert page.eval_on_selector_all(".cz-paths figure", "fs => fs.map(f => f.dataset.path)") == ["q", "k", "v"]
    q = page.evaluate("() => Array.from(window.__attnlens.current().detailMaps[2].model.data)")
    assert all(x != x for x in q[:H]) and all(x == x for x in q[H:])  # layer 0 masked (not after the sender), later drawn
    assert canvas_digest(page, '.cz-paths [data-path="q"] .heatmap-base')["colours"] > 3
    # the keyboard: focus the map, move with the arrows, Enter opens the head
    page.focus(".cz-maps .heatmap-overlay")
    page.keyboard.press("ArrowDown")
    assert "layer 1 · head 0" in page.inner_text("#tooltip")
    r = rendered(page)
    page.keyboard.press("Enter")
    wait_rendered(page, r, prefix="causes:1:0:")
    page.wait_for_selector('.cz-detail[data-head="1.0"][data-state="done"]')
    assert not [e for e in page.console_log.errors if "favicon" not in e]
    screenshot(page, "causes-desktop.png")
    # the exports: the map as PNG, the answers as JSON
    path, name = download(page, "#export-png")
    assert name == "attnlens-causes.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    path, name = download(page, "#export-json")
    data = json.loads(path.read_text())
    assert name == "attnlens-causes.json" and data["corrupted"] == CORRUPTED and data["patch"]["clean_metric"] == CLEAN_METRIC
    assert data["logit_attribution"]["heads"][L - 1][1 % H] == 2.76


def test_the_state_round_trips_through_the_url(page, server):
    routes = install(page, server)
    open_causes(page, server)
    patch(page)
    pick(page, "answer", 1)
    pick(page, "foil", 0)
    r = rendered(page)
    page.get_by_role("radio", name="Attribution").click()
    wait_rendered(page, r, prefix="causes:")
    r = rendered(page)
    page.select_option(".cz-bar select[name=component]", "layers")
    wait_rendered(page, r, prefix="causes:")
    assert page.eval_on_selector_all(".cz-maps figure", "fs => fs.map(f => f.dataset.part)") == ["attention", "mlp"]
    # the layers' maps are by position: a head is opened from the bars
    r = rendered(page)
    page.click('.cz-attr button[data-layer="1"][data-head="2"]')
    wait_rendered(page, r, prefix="causes:1:2:")
    page.wait_for_selector('.cz-detail[data-state="done"]')
    screenshot(page, "causes-layers.png")
    before = state(page, "[s.clean, s.corrupted, s.answer, s.foil, s.method, s.component, s.sender]")
    assert before[1:] == [CORRUPTED, before[2], before[3], "attribution", "layers", [1, 2]] and before[2] and before[3]
    body = routes.patch_bodies[-2] if routes.patch_bodies[-1]["component"] == "paths" else routes.patch_bodies[-1]
    for key in ("corrupted=", "answer=", "foil=", "method=attribution", "component=layers", "sender=1%2C2"):
        assert key in page.url, (key, page.url)
    # a reload brings it all back: the same requests, the same form, the detail open
    n = len(routes.patch_bodies)
    page.reload()
    page.wait_for_function("() => window.__attnlens.store.state.meta")
    wait_rendered(page, prefix="causes:")
    page.wait_for_selector('.cz-detail[data-state="done"]')
    assert state(page, "[s.clean, s.corrupted, s.answer, s.foil, s.method, s.component, s.sender]") == before
    assert page.input_value("#cz-corrupted") == CORRUPTED and page.input_value("#cz-answer") == before[2] and page.input_value("#cz-foil") == before[3]
    assert page.get_attribute('[data-method="attribution"]', "aria-checked") == "true"
    assert page.input_value(".cz-bar select[name=component]") == "layers"
    assert body in routes.patch_bodies[n:]
    assert page.inner_text(".cz-detail h3") == "Layer 1, head 2"


def test_a_typed_answer_and_an_error(page, server):
    routes = install(page, server)
    open_causes(page, server)
    patch(page)
    page.fill("input[name=answerTyped]", " sleep")
    r = rendered(page)
    page.click(".cz-run")
    wait_rendered(page, r, prefix="causes:")
    assert routes.patch_bodies[-1]["answer"] == " sleep"  # not in the list: sent as text
    assert page.eval_on_selector("#cz-answer", "s => s.options[s.selectedIndex].textContent") == "“␣sleep” (typed)"
    # an edit not applied yet survives a redraw (here: another diverging colour map)
    page.fill("#cz-corrupted", "not applied yet")
    r = rendered(page)
    page.evaluate("() => window.__attnlens.store.set({dcmap: 'berlin'})")
    wait_rendered(page, r, prefix="causes:")
    assert page.input_value("#cz-corrupted") == "not applied yet" and state(page, "s.corrupted") == CORRUPTED
    assert page.evaluate("() => window.__attnlens.current().maps[0].model.cmap") == "berlin"
    # a 4xx answer: the server's detail is shown
    routes.status = 422
    r = rendered(page)
    page.fill("#cz-corrupted", CORRUPTED.replace("question", "questions"))
    page.click(".cz-run")
    wait_rendered(page, r, prefix="causes:")
    assert "as many tokens as the clean one" in page.inner_text("#messages")


def test_270_heads_draw_in_under_300_ms_and_fit_a_phone(browser, server):
    """SmolLM2's 30 x 9 heads (the fixture's shape, whatever the model): drawn in under 300 ms,
    and at 390 px nothing reaches past the screen."""
    context = browser.new_context(viewport=PHONE, device_scale_factor=2, is_mobile=True, has_touch=True, color_scheme="light")
    pg = context.new_page()
    pg.console_log = type("C", (), {"errors": []})()
    try:
        install(pg, server, layers=30, heads=9)
        open_causes(pg, server)
        patch(pg)
        perf = pg.evaluate("() => window.__attnlens.perf.causes")
        assert perf["cells"] == 270 and perf["drawMs"] < 300, perf
        print("causes draw at 270 heads:", json.dumps(perf))
        # another method, drawn: the click to the view's mark of a finished drawing, in the page's clock
        pg.evaluate(CLICK_TO_RENDERED)
        for method in ("Attribution", "Exact"):
            r = rendered(pg)
            pg.get_by_role("radio", name=method).tap()
            wait_rendered(pg, r, prefix="causes:")
            perf = pg.evaluate("() => window.__attnlens.perf.causes")
            click_ms = pg.evaluate("() => window.__renderedAt - window.__clickAt")
            print(f"causes {method}: draw {perf['drawMs']:.1f} ms, click to drawn {click_ms:.1f} ms")
            assert perf["cells"] == 270 and perf["drawMs"] < 300, (method, perf)
        assert click_ms < 300, click_ms  # back to exact: every answer is in the page already
        m = pg.evaluate("() => { const h = window.__attnlens.current().maps[0]; return [h.model.rows, h.model.cols, h.layout.W]; }")
        assert m[:2] == [30, 9] and m[2] <= PHONE["width"], m
        s = spill(pg)
        assert s["scrollWidth"] <= PHONE["width"] and not s["wide"], s
        # the detail at the phone's width too (a head the tiny model has)
        pg.evaluate("() => window.__attnlens.store.set({sender: [1, 0]})")
        pg.wait_for_selector('.cz-detail[data-state="done"]')
        s = spill(pg)
        assert s["scrollWidth"] <= PHONE["width"] and not s["wide"], s
        screenshot(pg, "causes-phone.png")
        pg.locator(".cz-maps").scroll_into_view_if_needed()
        screenshot(pg, "causes-phone-map.png", full_page=False)
        pg.locator(".cz-detail").scroll_into_view_if_needed()
        screenshot(pg, "causes-phone-detail.png", full_page=False)
        before = rendered(pg)  # read before the resize: its redraw may come before a read after it
        pg.set_viewport_size({"width": 1280, "height": 900})
        wait_rendered(pg, before, prefix="causes:")
        screenshot(pg, "causes-270-desktop.png")
    finally:
        context.close()


def test_only_a_model_that_continues_its_prompt_has_the_tab(page, encoder_server):
    """Patching reads a causal language model: the decoder has the tab, the encoder not, and a
    link to the view on the encoder opens its first view instead."""
    open_page(page, encoder_server)
    assert page.is_visible("#tab-causes")
    page.goto(f"{encoder_server.base_url}/?model=genre&view=causes&prompt=a+film+about+a+cat")
    page.wait_for_function("() => window.__attnlens.store.state.meta?.name === 'genre'")
    wait_rendered(page)
    assert page.is_hidden("#tab-causes") and state(page, "s.view") == "head"
