"""The encoder's compare panel in Chromium (static/js/encoder/compare.js), on the bundled encoder
`encoder`: two sentences, one POST /v1/embeddings, their cosine (checked against the cosine of
the API's own vectors), and both sentences' attention side by side for the page's layer and head
(one POST /attention each, for just that map), redrawn when the head changes. The panel is not
there for the decoder, and it fits a phone's width. Screenshots go to /tmp."""

from __future__ import annotations

import urllib.parse
from pathlib import Path

import httpx
import numpy as np
import pytest

from .helpers import canvas_digest, record_attention_requests, spill, wait_rendered

TEXT = "the king is dead"
A = "the queen of France and the king"
B = "long live the king of England"
SHOTS = Path("/tmp")
MAP = "#compare-panel .compare-map[data-side='{}'] .heatmap-base"


@pytest.fixture
def server(bundled_server):
    return bundled_server


@pytest.fixture(autouse=True)
def no_console_errors(request):
    pg = request.getfixturevalue("phone" if "phone" in request.fixturenames else "page")
    yield
    assert not pg.console_log.errors, pg.console_log.errors


def open_encoder(pg, server, text=TEXT):
    pg.goto(f"{server.base_url}/?{urllib.parse.urlencode({'model': 'encoder', 'prompt': text})}")
    pg.wait_for_function("() => document.body.dataset.family === 'encoder'")
    wait_rendered(pg)
    pg.wait_for_selector("#compare-panel")


def api_cosine(server, a, b) -> float:
    r = httpx.post(server.base_url + "/v1/embeddings",
                   json={"model": "encoder", "input": [a, b], "encoding_format": "float"}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1]
    ea, eb = (np.array(d["embedding"], dtype=np.float64) for d in body["data"])
    assert np.linalg.norm(ea) == pytest.approx(1, abs=1e-4) and np.linalg.norm(eb) == pytest.approx(1, abs=1e-4)
    return float(ea @ eb)


def n_tokens(server, text) -> int:
    r = httpx.post(server.base_url + "/attention", json={"model": "encoder", "text": text, "layers": [0], "heads": [0],
                                                         "format": "f16"}, timeout=60)
    assert r.status_code == 200, r.text
    return len(r.json()["tokens"])


def compare(pg, a, b, *, enter=False):
    """Fill both fields, compare (the button, or Enter in B), wait for the cosine and both maps."""
    pg.fill("#compare-a", a)
    pg.fill("#compare-b", b)
    pg.evaluate("() => { document.querySelector('#compare-results').replaceChildren();"
                " delete document.querySelector('#compare-maps').dataset.drawn; }")
    if enter:
        pg.press("#compare-b", "Enter")
    else:
        pg.click("#compare")
    pg.wait_for_selector("#compare-cosine")
    pg.wait_for_selector("#compare-maps[data-drawn]")
    pg.wait_for_function("() => !document.querySelector('#compare').disabled")
    return float(pg.inner_text("#compare-cosine"))


def test_compare_two_sentences_cosine_and_maps(page, server):
    open_encoder(page, server)
    # sentence A starts as the analysed text; B is empty, with a placeholder
    assert page.input_value("#compare-a") == TEXT
    assert page.input_value("#compare-b") == "" and page.get_attribute("#compare-b", "placeholder") == "another sentence"
    requests = record_attention_requests(page)
    shown = compare(page, A, B)
    assert shown == pytest.approx(api_cosine(server, A, B), abs=1e-3)
    assert page.inner_text("#compare-cosine") == f"{float(page.get_attribute('.cos-row', 'data-cosine')):.3f}"
    # the panel asked /attention for the page's layer and head only, once per sentence
    asked = [r for r in requests if r.get("text") in (A, B)]
    assert sorted(r["text"] for r in asked) == sorted([A, B])
    assert all(r["layers"] == [0] and r["heads"] == [0] for r in asked)
    # two heatmaps, drawn, each the size of its own sentence (token labels on both axes)
    before = {}
    for side, text in (("a", A), ("b", B)):
        d = canvas_digest(page, MAP.format(side))
        assert d and d["nonBlank"] > 0 and d["colours"] > 8, (side, d)
        assert page.get_attribute(f".compare-map[data-side='{side}']", "data-tokens") == str(n_tokens(server, text))
        before[side] = d["hash"]
    assert page.inner_text("#compare-panel .compare-title") == "Layer 0 · head 0"
    page.locator("#compare-panel").screenshot(path=str(SHOTS / "compare-panel-desktop.png"))
    # another head: both maps are fetched again for it and redrawn
    del requests[:]
    page.select_option("#head", "2")
    page.wait_for_selector("#compare-maps[data-drawn='0:2']")
    asked = [r for r in requests if r.get("text") in (A, B)]
    assert len(asked) == 2 and all(r["layers"] == [0] and r["heads"] == [2] for r in asked)
    for side in ("a", "b"):
        assert canvas_digest(page, MAP.format(side))["hash"] != before[side], side
    assert page.inner_text("#compare-panel .compare-title") == "Layer 0 · head 2"
    page.locator("#compare-panel").scroll_into_view_if_needed()
    page.screenshot(path=str(SHOTS / "compare-desktop.png"))
    # Enter in a field compares too; the cosine follows the new sentence
    other = "a horse, a horse, my kingdom for a horse"
    shown = compare(page, A, other, enter=True)
    assert shown == pytest.approx(api_cosine(server, A, other), abs=1e-3)
    assert page.get_attribute("#compare-maps", "data-drawn") == "0:2"
    # the button is disabled while the panel's requests run, and back once they are answered
    assert page.evaluate("() => { const b = document.querySelector('#compare'); b.click(); return b.disabled; }")
    page.wait_for_function("() => !document.querySelector('#compare').disabled")
    assert float(page.inner_text("#compare-cosine")) == pytest.approx(shown, abs=1e-3)
    # an empty sentence is not sent: the page says what to do
    page.fill("#compare-b", "")
    page.click("#compare")
    page.wait_for_selector("#messages .message.warn")
    assert "another sentence in B" in page.inner_text("#messages")
    # the decoder has no embeddings task: no compare panel
    r = wait_rendered(page)
    page.select_option("#model-picker", "")
    page.wait_for_function("() => document.body.dataset.family === 'decoder'")
    wait_rendered(page, r)
    assert page.locator("#compare-panel").count() == 0


def test_compare_panel_fits_a_phone(phone, server):
    open_encoder(phone, server)
    compare(phone, A, B)
    assert float(phone.inner_text("#compare-cosine")) == pytest.approx(api_cosine(server, A, B), abs=1e-3)
    panel = phone.locator("#compare-panel").bounding_box()
    assert panel["x"] >= 0 and panel["x"] + panel["width"] <= 390
    for side in ("a", "b"):
        box = phone.locator(f"#compare-panel .compare-map[data-side='{side}'] .heatmap").bounding_box()
        assert box["width"] > 0 and box["x"] >= panel["x"] and box["x"] + box["width"] <= panel["x"] + panel["width"], (side, box, panel)
    wide = spill(phone)
    assert wide["scrollWidth"] <= wide["viewport"] and not [w for w in wide["wide"] if "compare" in w], wide
    phone.locator("#compare-panel").screenshot(path=str(SHOTS / "compare-panel-phone.png"))
    phone.locator("#compare-panel").scroll_into_view_if_needed()
    phone.screenshot(path=str(SHOTS / "compare-phone.png"))


def test_a_heads_reported_figure_is_shown_and_a_weak_one_marked(page, server):
    """The bundled encoder's training report: its genre head (73.4% balanced) loses to bag of words
    (80.2%), so /models calls it weak and the classify panel says so, with both figures."""
    figures = httpx.get(server.base_url + "/models").json()["models"]
    encoder = next(m for m in figures if m["name"] == "encoder")["head_figures"]["classify"]
    assert encoder["weak"] and encoder["value"] < encoder["baseline"]
    open_encoder(page, server)
    text = page.inner_text("#classify-panel .head-figure")
    assert "weak head" in text and f"{100 * encoder['value']:.1f}%" in text and f"{100 * encoder['baseline']:.1f}%" in text
    assert page.locator("#fill-mask-panel .head-figure").count() == 0  # no fill-mask figure in its report
