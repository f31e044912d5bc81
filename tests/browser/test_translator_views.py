"""The page with the translator: cross-attention heatmap (target down, source across) per head,
per layer and averaged, the alignment lines, the decoder's self-attention, and stepping
through the translation; the encoder's self-attention in the existing views."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import REPO_ROOT
from live_server import live_server

from attnlens.app.serving.attention_codec import decode

from .helpers import api_attention, canvas_digest, open_page, rendered, screenshot, state, wait_rendered

TRANSLATOR = REPO_ROOT / "checkpoints" / "translator"
SOURCE = "Wednesday, March 3, 2021"


@pytest.fixture(scope="module")
def translator_server(tmp_path_factory):
    if not (TRANSLATOR / "model.safetensors").is_file():
        pytest.skip("the bundled translator is not in checkpoints/translator")
    with live_server(TRANSLATOR, tmp_path_factory.mktemp("browser-translator-logs")) as srv:
        yield srv


def heatmap_labels(page):
    return page.evaluate("() => { const m = window.__attnlens.current().heatmap.model; "
                         "return {rows: m.rowLabels, cols: m.colLabels, n: m.rows, m: m.cols}; }")


def test_cross_view_shows_target_rows_over_source_columns(page, translator_server):
    open_page(page, translator_server, prompt=SOURCE, view="cross", layer=2, head=1)
    api = api_attention(translator_server, SOURCE)
    tr = api["translation"]
    labels = heatmap_labels(page)
    assert labels["n"] == len(tr["target_tokens"]) and labels["m"] == len(api["tokens"])
    assert [t for t in labels["cols"]][-1].strip() and len(labels["rows"]) == labels["n"]
    # the drawn matrix is the API's cross-attention of layer 2, head 1
    shown = np.asarray(page.evaluate("() => Array.from(window.__attnlens.current().result.data)"))
    want = decode(tr["cross"])[2, 1].reshape(-1)
    np.testing.assert_allclose(shown, want, atol=1e-5)
    assert "Cross-attention" in page.inner_text("#caption")
    assert page.is_visible("#tab-cross") and page.is_visible("#tab-align") and page.is_visible("#tab-decoder")
    screenshot(page, "translator-cross.png")

    # the layer's mean and the mean of all are other pictures, and say so
    digest = canvas_digest(page)
    r = rendered(page)
    page.select_option("#xavg", "layer")
    wait_rendered(page, r)
    assert canvas_digest(page)["hash"] != digest["hash"] and "mean of its heads" in page.inner_text("#caption")
    shown = np.asarray(page.evaluate("() => Array.from(window.__attnlens.current().result.data)"))
    np.testing.assert_allclose(shown, decode(tr["cross"])[2].mean(0).reshape(-1), atol=1e-5)
    assert state(page, "s.xavg") == "layer"


def test_stepping_through_the_translation_names_the_source_each_step_reads(page, translator_server):
    open_page(page, translator_server, prompt=SOURCE, view="cross", xavg="all")
    tr = api_attention(translator_server, SOURCE)["translation"]
    mean = decode(tr["cross"]).mean((0, 1))  # (T, S)
    src = [t["text"] for t in api_attention(translator_server, SOURCE)["tokens"]]
    for step in range(3):
        page.click("[data-step=next]")
        page.wait_for_function(f"() => window.__attnlens.store.state.pin[0] === {step}")
        note = page.inner_text("#translation-step-note")
        assert note.startswith(f"Step {step + 1} of {len(tr['target_tokens'])}")
        best = src[int(mean[step].argmax())].replace(" ", "␣")
        assert f"“{best}”" in note, (note, best)
    screenshot(page, "translator-steps.png")


def test_alignment_lines_and_decoder_view(page, translator_server):
    open_page(page, translator_server, prompt=SOURCE, view="align")
    assert canvas_digest(page, "#view-host .align-canvas")["nonBlank"] > 1000
    assert "Alignment" in page.inner_text("#caption")
    screenshot(page, "translator-alignment.png")
    r = rendered(page)
    page.click("#tab-decoder")
    wait_rendered(page, r)
    labels = heatmap_labels(page)
    T = len(api_attention(translator_server, SOURCE)["translation"]["target_tokens"])
    assert labels["n"] == labels["m"] == T and "Decoder self-attention" in page.inner_text("#caption")
    screenshot(page, "translator-decoder.png")


def test_head_view_shows_the_encoders_self_attention_and_decoder_models_hide_the_tabs(page, translator_server, server):
    open_page(page, translator_server, prompt=SOURCE, view="head")
    labels = heatmap_labels(page)
    S = len(api_attention(translator_server, SOURCE)["tokens"])
    assert labels["n"] == labels["m"] == S
    open_page(page, server, view="head")
    assert page.is_hidden("#tab-cross") and page.is_hidden("#tab-align") and page.is_hidden("#tab-decoder")


def test_generating_a_translation_steps_through_the_source_each_token_read(page, translator_server):
    import httpx

    open_page(page, translator_server, prompt="ninety-seven", view="gen")
    page.fill("#temperature", "0")
    page.click("#generate")
    page.wait_for_function("() => { const g = window.__attnlens.store.state.gen; "
                           "return g && g.done !== undefined && !window.__attnlens.store.state.streaming; }")
    wait_rendered(page)
    want = httpx.post(f"{translator_server.base_url}/generate", timeout=60, json={
        "prompt": "ninety-seven", "temperature": 0, "max_new_tokens": 32, "return_attention": True}).json()
    assert "".join(t["text"] for t in state(page, "s.gen.tokens")) == want["text"] == "quatre-vingt-dix-sept"
    S = len(want["prompt_tokens"])
    result = page.evaluate("() => { const r = window.__attnlens.current().result; return {S: r.S, step: r.step, "
                           "data: Array.from(r.data)}; }")
    assert result["S"] == S  # columns are the source tokens
    step = result["step"]
    np.testing.assert_allclose(np.asarray(result["data"]).reshape(-1),
                               np.asarray(want["cross_attention"][step]).reshape(-1), atol=1e-5)
    assert "cross-attention of the decoder step" in page.inner_text("#caption")
    screenshot(page, "translator-generation.png")


@pytest.fixture(scope="module")
def pair_server(tiny_checkpoint, tmp_path_factory):
    """The tiny decoder (the default) and the translator, side by side."""
    if not (TRANSLATOR / "model.safetensors").is_file():
        pytest.skip("the bundled translator is not in checkpoints/translator")
    env = {"ATTNLENS_MODELS": f"{tiny_checkpoint},{TRANSLATOR}"}
    with live_server(tiny_checkpoint, tmp_path_factory.mktemp("browser-pair-logs"), env=env) as srv:
        yield srv


def test_picking_the_translator_shows_its_views_and_its_model(page, pair_server):
    open_page(page, pair_server, prompt=SOURCE, model="translator", view="cross")
    page.wait_for_function("() => document.body.dataset.family === 'encoder-decoder'")  # the page fits the picked model's family
    assert state(page, "s.meta.name") == "translator" and state(page, "s.meta.n_layers") == 3
    assert page.input_value("#model-picker") == "translator"  # the picker (state key `model`) shows it
    assert page.is_visible("#tab-cross")
    labels = heatmap_labels(page)
    assert labels["m"] == len(api_attention_model(pair_server, "translator", SOURCE)["tokens"])
    screenshot(page, "translator-picked.png")
    open_page(page, pair_server, view="head")  # the default decoder: no translator tabs
    assert page.is_hidden("#tab-cross") and state(page, "s.meta.n_layers") == 2


def api_attention_model(server, model, text):
    import httpx

    r = httpx.post(f"{server.base_url}/attention", json={"model": model, "text": text, "format": "json"}, timeout=60)
    r.raise_for_status()
    return r.json()


def test_the_picker_switches_to_the_translator_in_place(page, pair_server):
    """Choosing the translator in the picker (state key `model`, no reload) brings its family's
    tabs, keeps generation (it translates), and its encoder's maps are full squares."""
    open_page(page, pair_server, prompt=SOURCE)
    assert page.is_hidden("#tab-cross") and page.evaluate("() => window.__attnlens.current().heatmap.model.causal") is True
    r = rendered(page)
    page.evaluate("() => { window.__samePage = 1; }")
    page.select_option("#model-picker", "translator")
    page.wait_for_function("() => document.body.dataset.family === 'encoder-decoder'")
    wait_rendered(page, r)
    assert page.evaluate("() => window.__samePage") == 1 and "model=translator" in page.url
    assert page.is_visible("#tab-cross") and page.is_visible("#tab-gen") and page.is_visible("#generate")
    assert page.locator("#fill-mask-panel").count() == 0 and page.is_hidden("#enc-focus-pooled")
    api = api_attention_model(pair_server, "translator", SOURCE)
    heat = page.evaluate("() => { const m = window.__attnlens.current().heatmap.model; return [m.causal, m.rows, m.cols]; }")
    assert heat == [False, len(api["tokens"]), len(api["tokens"])]
    r = rendered(page)
    page.click("#tab-cross")
    wait_rendered(page, r, prefix="cross:")
    assert heatmap_labels(page)["n"] == len(api["translation"]["target_tokens"])
