"""The Causes view on the translator (an encoder-decoder) in Chromium, against the bundled translator's
real server and its real /patch and /logit-attribution: two sources and a target typed, a map per
group (encoder, decoder and cross heads) equal to the route's answer, the target's metric position
marked, a cross head clicked (its attention on both sources, its direct logit attribution), an
encoder head's paths by receiver group, the residual and layers figures by stack, the state through a reload, and the phone width."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from helpers import TRANSLATOR_CLEAN as CLEAN
from helpers import TRANSLATOR_CORRUPTED as CORRUPTED
from helpers import TRANSLATOR_TARGET as TARGET
from helpers import bundled_translator_dir
from live_server import live_server

from .conftest import PHONE
from .helpers import canvas_digest, open_page, rendered, screenshot, spill, state, wait_rendered


@pytest.fixture(scope="module")
def translator_server(tmp_path_factory):
    with live_server(bundled_translator_dir(), tmp_path_factory.mktemp("browser-causes-translator-logs")) as srv:
        yield srv


def post(server, route: str, **body) -> dict:
    r = httpx.post(f"{server.base_url}{route}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def open_patched(page, server, **query) -> None:
    """The Causes view on the clean source, the corrupted one and the target typed, Patch pressed."""
    open_page(page, server, prompt=CLEAN, view="causes", **query)
    assert page.is_visible("#cz-target") and page.inner_text('label[for="cz-clean"]') == "Clean source"
    page.fill("#cz-corrupted", CORRUPTED)
    page.fill("#cz-target", TARGET)
    page.fill("input[name=foilTyped]", " mai")
    r = rendered(page)
    page.click(".cz-run")
    wait_rendered(page, r, prefix="causes:")
    page.wait_for_function("() => window.__attnlens.current().patch")


def normalised(answer: dict, rows) -> np.ndarray:
    return (np.array(rows, dtype=np.float64) - answer["corrupted_metric"]) / (answer["clean_metric"] - answer["corrupted_metric"])


def test_the_translators_groups_are_drawn_and_a_cross_head_opens(page, translator_server):
    open_patched(page, translator_server)
    assert state(page, "[s.corrupted, s.ctarget, s.foil]") == [CORRUPTED, TARGET, " mai"]
    assert page.input_value("#cz-answer") == " mars"  # the top prediction after "3"
    want = post(translator_server, "/patch", clean=CLEAN, corrupted=CORRUPTED, target=TARGET, answer=" mars", foil=" mai")
    # a map per group, layers x heads, each the route's answer normalised
    assert page.eval_on_selector_all(".cz-maps figure", "fs => fs.map(f => f.dataset.part)") == ["encoder", "decoder", "cross"]
    for i, group in enumerate(("encoder", "decoder", "cross")):
        shape = page.evaluate(f"() => {{ const m = window.__attnlens.current().maps[{i}].model; return [m.rows, m.cols]; }}")
        assert shape == [3, 4]
        got = np.array(page.evaluate(f"() => Array.from(window.__attnlens.current().maps[{i}].model.data)"))
        np.testing.assert_allclose(got, normalised(want, want["values"][group]).ravel(), atol=1e-4)
    assert canvas_digest(page, '.cz-maps figure[data-part="cross"] .heatmap-base')["colours"] > 3
    # the sources' differing token, the target's metric position
    assert page.inner_text('.cz-tokens[data-side="clean"] mark.diff') == "March"
    assert page.inner_text('.cz-tokens[data-side="corrupted"] mark.diff') == "May"
    assert page.eval_on_selector_all('.cz-tokens[data-side="target"] .cz-tok', "ts => ts.map(t => t.textContent)") == \
        ["⟨start⟩", "3"]
    assert page.inner_text('.cz-tokens[data-side="target"] mark') == "3"
    assert "at target #1" in page.inner_text(".cz-metrics")
    # the attribution chart: decoder and cross heads and MLPs ranked by size, a last-layer cross head first
    dla = post(translator_server, "/logit-attribution", text=CLEAN, target=TARGET, answer=" mars", foil=" mai")
    cross = np.abs(np.array(dla["heads"]["cross"]))
    names = page.eval_on_selector_all(".cz-bar-row .cz-bar-name", "bs => bs.map(b => b.textContent)")
    assert names[0] == "cross L2 H{}".format(int(cross[2].argmax())) and cross.max() > np.abs(dla["mlps"]).max()
    assert all(n.startswith(("cross ", "self ", "MLP ")) for n in names) and len(names) == 12
    # a cross head clicked: its group's maps on both sources (target rows, source columns), its attribution
    page.locator('.cz-maps figure[data-part="cross"] .heatmap-overlay').scroll_into_view_if_needed()
    xy = page.evaluate("() => window.__attnlens.current().maps[2].cellCenter(2, 1)")
    r = rendered(page)
    page.mouse.click(xy["x"], xy["y"])
    wait_rendered(page, r, prefix="causes:2:1:")
    page.wait_for_selector('.cz-detail[data-head="cross.2.1"][data-state="done"]')
    assert state(page, "s.sender") == [2, 1, 2]
    assert page.inner_text(".cz-detail h3") == "Cross-attention: layer 2, head 1"
    assert page.inner_text(".cz-detail [data-dla]") == f"+{dla['heads']['cross'][2][1]:.3f}"
    effect = normalised(want, want["values"]["cross"])[2, 1]
    assert page.inner_text(".cz-detail [data-effect]") == f"{effect:.3f}"
    for i, side in enumerate(("clean", "corrupted")):
        shape = page.evaluate(f"() => {{ const m = window.__attnlens.current().detailMaps[{i}].model; return [m.rows, m.cols]; }}")
        assert shape == [2, 4], side  # the start token and "3" down, the four source tokens across
        assert canvas_digest(page, f'.cz-att figure[data-side="{side}"] .heatmap-base').get("colours", 0) > 3
    assert "No head reads this one directly" in page.inner_text(".cz-paths")  # the last layer's cross head
    marked = page.evaluate("() => window.__attnlens.current().maps.map(m => m.marked)")
    assert marked == [None, None, {"row": 2, "col": 1}]  # only the cross map outlines the head
    # an encoder head from its map: no direct logit attribution, said so
    xy = page.evaluate("() => window.__attnlens.current().maps[0].cellCenter(0, 3)")
    r = rendered(page)
    page.mouse.click(xy["x"], xy["y"])
    wait_rendered(page, r, prefix="causes:0:3:")
    page.wait_for_selector('.cz-detail[data-head="encoder.0.3"][data-state="done"]')
    assert "writes no logit directly" in page.inner_text(".cz-detail [data-dla]")
    assert page.evaluate("() => window.__attnlens.current().detailMaps[0].model.rows") == 4  # source x source
    # its paths: into the later encoder heads' q, k, v and every cross head's k, v (the memory), the route's
    grids = ["encoder.q", "encoder.k", "encoder.v", "cross.k", "cross.v"]
    assert page.eval_on_selector_all(".cz-paths figure", "fs => fs.map(f => f.dataset.path)") == grids
    paths = post(translator_server, "/patch", clean=CLEAN, corrupted=CORRUPTED, target=TARGET, answer=" mars",
                 foil=" mai", component="paths", sender={"group": "encoder", "layer": 0, "head": 3})
    for i, grid in enumerate(grids):
        group, kind = grid.split(".")
        got = np.array(page.evaluate(f"() => Array.from(window.__attnlens.current().detailMaps[{2 + i}].model.data)"))
        want = normalised(paths, [[np.nan if v is None else v for v in row] for row in paths["values"][group][kind]])
        np.testing.assert_allclose(got, want.ravel(), atol=1e-4)  # layer 0 of the encoder's: NaN, not after it
    assert not [e for e in page.console_log.errors if "favicon" not in e]
    screenshot(page, "causes-translator.png")


def test_residual_and_layers_by_stack_and_the_state_through_a_reload(page, translator_server):
    open_patched(page, translator_server)
    r = rendered(page)
    page.select_option(".cz-bar select[name=component]", "residual")
    wait_rendered(page, r, prefix="causes:")
    assert page.eval_on_selector_all(".cz-maps figure", "fs => fs.map(f => f.dataset.part)") == ["encoder", "decoder"]
    cols = page.evaluate("() => window.__attnlens.current().maps.map(m => m.model.colLabels)")
    assert len(cols[0]) == 4 and len(cols[1]) == 2  # source positions, target positions
    r = rendered(page)
    page.get_by_role("radio", name="Attribution").click()
    wait_rendered(page, r, prefix="causes:")
    r = rendered(page)
    page.select_option(".cz-bar select[name=component]", "layers")
    wait_rendered(page, r, prefix="causes:")
    parts = ["encoder.attention", "encoder.mlp", "decoder.attention", "decoder.cross", "decoder.mlp"]
    assert page.eval_on_selector_all(".cz-maps figure", "fs => fs.map(f => f.dataset.part)") == parts
    want = post(translator_server, "/patch", clean=CLEAN, corrupted=CORRUPTED, target=TARGET, answer=" mars", foil=" mai",
                component="layers", method="attribution")
    got = np.array(page.evaluate("() => Array.from(window.__attnlens.current().maps[3].model.data)"))
    np.testing.assert_allclose(got, normalised(want, want["values"]["decoder"]["cross"]).ravel(), atol=1e-4)
    for key in ("ctarget=3", "method=attribution", "component=layers", "corrupted=May"):
        assert key in page.url, (key, page.url)
    before = state(page, "[s.clean, s.corrupted, s.ctarget, s.answer, s.foil, s.method, s.component]")
    page.reload()
    page.wait_for_function("() => window.__attnlens.store.state.meta")
    wait_rendered(page, prefix="causes:")
    page.wait_for_function("() => window.__attnlens.current().patch")
    assert state(page, "[s.clean, s.corrupted, s.ctarget, s.answer, s.foil, s.method, s.component]") == before
    assert page.input_value("#cz-target") == TARGET and page.input_value("#cz-corrupted") == CORRUPTED
    assert page.eval_on_selector_all(".cz-maps figure", "fs => fs.map(f => f.dataset.part)") == parts
    screenshot(page, "causes-translator-layers.png")


def test_the_translators_view_fits_a_phone(browser, translator_server):
    context = browser.new_context(viewport=PHONE, device_scale_factor=2, is_mobile=True, has_touch=True)
    pg = context.new_page()
    pg.console_log = type("C", (), {"errors": []})()
    try:
        open_patched(pg, translator_server)
        pg.evaluate("() => window.__attnlens.store.set({sender: [2, 1, 2]})")
        pg.wait_for_selector('.cz-detail[data-head="cross.2.1"][data-state="done"]')
        s = spill(pg)
        assert s["scrollWidth"] <= PHONE["width"] and not s["wide"], s
        screenshot(pg, "causes-translator-phone.png")
    finally:
        context.close()
