"""The encoder in Chromium, on the page's store and views: the model picker (state key
`model`), full square attention heatmaps in the shared views, the fill-mask panel (click a
token to mask it; candidates with probability bars), the classify panel, and the pooled
position's attention one click away (a pin of its rows). Figures are checked against the
API's own answers."""

from __future__ import annotations

import urllib.parse

import httpx
import numpy as np
import pytest

from attnlens.app.serving.attention_codec import decode

from .helpers import ARTIFACTS, state, wait_rendered

TEXT = "the queen of France and the king"


@pytest.fixture
def server(encoder_server):
    return encoder_server


@pytest.fixture(autouse=True)
def no_console_errors(page):
    yield
    assert not page.console_log.errors, page.console_log.errors


def open_encoder(page, server, text=TEXT):
    page.goto(f"{server.base_url}/?{urllib.parse.urlencode({'model': 'genre', 'prompt': text})}")
    page.wait_for_function("() => document.body.dataset.family === 'encoder'")
    wait_rendered(page)
    page.wait_for_selector("#enc-chips .enc-chip")


def api_attention(server, text):
    r = httpx.post(server.base_url + "/attention", json={"model": "genre", "text": text, "format": "f16"})
    assert r.status_code == 200
    return r.json(), decode(r.json())


def test_picker_lists_the_models_and_the_encoder_page_adapts(page, server, tiny_checkpoint):
    open_encoder(page, server)
    # the picker is bound to state key `model`; the default model's option stands for "" (the default)
    options = page.eval_on_selector_all("#model-picker option", "os => os.map(o => [o.value, o.textContent.split(' ')[0], o.selected])")
    assert options == [["", tiny_checkpoint.name, False], ["genre", "genre", True]]
    assert page.get_attribute("#model-picker", "data-key") == "model" and state(page, "s.model") == "genre"
    # the encoder analyses its text (the store's prompt), it does not generate
    assert page.is_hidden("#generate") and page.is_hidden(".params") and page.is_hidden(".output-panel")
    assert page.is_visible("#prompt") and page.input_value("#prompt") == TEXT and state(page, "s.prompt") == TEXT
    assert page.is_visible("#fill-mask-panel") and page.is_visible("#classify-panel")
    assert page.is_hidden("#tab-gen") and page.is_visible("#tab-head") and page.is_visible("#enc-focus-pooled")
    body, maps = api_attention(server, TEXT)
    T = len(body["tokens"])
    assert body["direction"] == "bidirectional"
    assert page.inner_text("#caption").startswith(f"Layer 0 · head 0 — {T} × {T}, bidirectional")
    chips = page.eval_on_selector_all("#enc-chips .enc-chip", "cs => cs.map(c => c.textContent)")
    assert chips[0] == "[CLS]" and chips[-1] == "[SEP]" and len(chips) == T
    # the square heatmap has colour above the diagonal (no causal mask painted)
    grey = page.evaluate("""() => {
        const c = document.querySelector('#view-host .heatmap-base');
        return [c.width, c.height];
    }""")
    assert grey[0] > 0 and abs(grey[0] - grey[1]) < grey[0] * 0.6
    heat = page.evaluate("() => { const m = window.__attnlens.current().heatmap.model; return [m.causal, m.rows, m.cols]; }")
    assert heat == [False, T, T]
    # hovering a cell above the diagonal shows its weight (a causal map would say "masked")
    box = page.locator("#view-host .heatmap-base").bounding_box()
    page.mouse.move(box["x"] + box["width"] * (T - 0.5) / T, box["y"] + box["height"] * 0.5 / T)
    page.wait_for_selector("#tooltip:not([hidden])")
    assert "masked" not in page.inner_text("#tooltip")
    # switching to the decoder brings back the generate page, its causal maps and its tabs
    r = wait_rendered(page)
    page.select_option("#model-picker", "")
    page.wait_for_function("() => document.body.dataset.family === 'decoder'")
    wait_rendered(page, r)
    assert page.is_visible("#generate") and page.is_visible(".output-panel") and "model=" not in page.url
    assert page.is_visible("#tab-gen") and page.is_hidden("#enc-focus-pooled")
    assert page.locator("#fill-mask-panel").count() == 0 and page.locator("#classify-panel").count() == 0
    assert page.evaluate("() => window.__attnlens.current().heatmap.model.causal") is True


def test_click_a_token_to_mask_it_and_see_candidates(page, server):
    open_encoder(page, server)
    tokens = [t["text"] for t in api_attention(server, TEXT)[0]["tokens"]]
    i = tokens.index(" of")
    page.click(f"#enc-chips .enc-chip[data-index='{i}']")
    page.wait_for_selector("#fill-results .prob-row")
    text = page.input_value("#prompt")
    assert text == "".join(tokens[1:i]) + " [MASK]" + "".join(tokens[i + 1 : -1])
    assert text.endswith("[MASK] France and the king")
    # the masked text is the store's prompt, so the link carries it
    assert state(page, "s.prompt") == text and urllib.parse.parse_qs(urllib.parse.urlsplit(page.url).query)["prompt"] == [text]
    rows = page.eval_on_selector_all("#fill-results .prob-row", "rs => rs.map(r => [r.dataset.token, r.querySelector('.prob-fill').style.width])")
    want = httpx.post(server.base_url + "/fill-mask", json={"model": "genre", "text": text, "top_k": 5}).json()
    assert [int(t) for t, _ in rows] == [c["token"] for c in want["masks"][0]]
    for (_, width), c in zip(rows, want["masks"][0]):
        assert float(width.rstrip("%")) == pytest.approx(100 * c["score"], abs=0.06)
    assert page.eval_on_selector("#enc-chips .enc-chip.masked", "c => c.textContent") == "[MASK]"


def test_typed_masks_and_classify(page, server):
    open_encoder(page, server, text="a [MASK] and a [MASK]")
    page.click("#fill-mask")
    page.wait_for_selector("#fill-results .enc-mask:nth-child(2)")
    assert page.inner_text("#fill-results .enc-mask h3") == "[MASK] 1 of 2"
    # top-k is state key `fillk`: changing it asks again and the link carries it
    page.fill("#fill-top-k", "3")
    page.press("#fill-top-k", "Enter")
    page.wait_for_function("() => document.querySelectorAll('#fill-results .enc-mask:first-child .prob-row').length === 3")
    assert state(page, "s.fillk") == 3 and "fillk=3" in page.url
    want = httpx.post(server.base_url + "/fill-mask", json={"model": "genre", "text": "a [MASK] and a [MASK]", "top_k": 3}).json()
    rows = page.eval_on_selector_all("#fill-results .enc-mask:nth-child(2) .prob-row", "rs => rs.map(r => +r.dataset.token)")
    assert rows == [c["token"] for c in want["masks"][1]]
    page.click("#classify")
    page.wait_for_selector("#classify-results .prob-row")
    labels = page.eval_on_selector_all("#classify-results .prob-row", "rs => rs.map(r => r.dataset.label)")
    want = httpx.post(server.base_url + "/classify", json={"model": "genre", "text": "a [MASK] and a [MASK]"}).json()
    assert labels == [x["label"] for x in want["labels"]]


def test_pooled_attention_is_one_click_away(page, server):
    open_encoder(page, server)
    r = wait_rendered(page)
    page.select_option("#layer", "1")
    wait_rendered(page, r)
    page.click("#enc-focus-pooled")
    page.wait_for_selector("#enc-pooled .prob-row")
    values = page.eval_on_selector_all("#enc-pooled .prob-value", "vs => vs.map(v => parseFloat(v.textContent))")
    body, maps = api_attention(server, TEXT)
    pooled = maps[1, 0].mean(axis=0)  # the genre model pools by the mean: the mean of the rows
    assert len(values) == len(body["tokens"])
    assert np.allclose(np.array(values) / 100, pooled, atol=0.0006)
    assert "mean-pooled" in page.inner_text("#enc-pooled h3")
    # the click pinned the rows the pooled vector is made of (every row, for mean pooling)
    assert state(page, "s.pin") == list(range(len(body["tokens"])))
    assert page.get_attribute("#enc-focus-pooled", "aria-pressed") == "true"
    page.click("#classify")
    page.wait_for_selector("#classify-results .prob-row")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "encoder-page.png"), full_page=True)
    page.click("#enc-focus-pooled")
    page.wait_for_selector("#enc-pooled", state="hidden")
    assert state(page, "s.pin") == []
