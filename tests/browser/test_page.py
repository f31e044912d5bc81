"""The page in Chromium: loading, generating, the views, errors, the theme (fixtures in
conftest.py, helpers in helpers.py). Screenshots go to test-artifacts/."""

from __future__ import annotations

import json
import urllib.parse
from pathlib import Path

import httpx
import pytest

from .conftest import DESKTOP
from .helpers import (
    ARTIFACTS,
    PROMPT,
    api_attention,
    canvas_digest,
    open_page,
    record_attention_requests,
    rendered,
    screenshot,
    visible,
    wait_rendered,
)


def test_page_loads_without_console_errors(page, server):
    open_page(page, server)
    assert page.title().startswith("attnlens")
    assert "layers" in page.inner_text("#model-info")
    assert page.eval_on_selector("#tab-head", "e => e.getAttribute('aria-selected')") == "true"
    # served by the app itself: no request leaves localhost
    assert not page.console_log.errors, page.console_log.errors
    path = screenshot(page, "browser-head-view.png")
    assert path.stat().st_size > 10_000


def test_generate_streams_tokens_into_the_page(page, default_server):
    server = default_server
    open_page(page, server)
    page.fill("#prompt", "To be, or not")
    # long enough (about half a second on a 2-core CPU) that the stream outlasts the page's own
    # busy moments: with 64 tokens a loaded CI machine once read the whole stream in one task
    page.fill("#max_new_tokens", "200")
    page.fill("#temperature", "0")
    page.fill("#seed", "1")
    # record each separate moment chips were added: a stream adds them over several tasks
    page.evaluate(
        """() => {
            window.__batches = [];
            new MutationObserver(() => {
                window.__batches.push(document.querySelectorAll('#output .tok.gen').length);
            }).observe(document.querySelector('#output'), {childList: true});
        }"""
    )
    requests = record_attention_requests(page)
    before = rendered(page)
    page.click("#generate")
    page.wait_for_selector("#output[data-done]", state="attached", timeout=60_000)
    chips = page.locator("#output .tok.gen")
    n = chips.count()
    assert n >= 1
    assert "finished" in page.inner_text("#gen-status")
    batches = [b for b in page.evaluate("window.__batches") if b > 0]
    assert len(set(batches)) >= 2, f"all tokens arrived at once: {batches}"
    # the page's text is the prompt plus what was generated
    assert page.inner_text("#output").startswith("To be, or not")
    # a generated token's tooltip shows its probability and alternatives
    chips.nth(0).hover()
    tip = page.inner_text("#tooltip")
    assert "p =" in tip and "logprob" in tip and "top alternatives" in tip
    # clicking it opens the generated-token view at that step
    before = wait_rendered(page, before, prefix="head:")  # the analysis of prompt + generated text
    # the prompt's tokens came with the stream's `done` event: no /attention call just for them,
    # and the analysis asks for exactly the prompt's + the generated token ids
    prompt_ids = [t["id"] for t in api_attention(server, "To be, or not")["tokens"]]
    gen = page.evaluate("() => ({prompt: window.__attnlens.store.state.gen.promptTokens, tokens: window.__attnlens.store.state.gen.tokens})")
    assert [t["id"] for t in gen["prompt"]] == prompt_ids
    gen_ids = [t["id"] for t in gen["tokens"]]
    assert len(gen_ids) == n
    assert [r.get("ids") for r in requests] == [prompt_ids + gen_ids], requests
    assert all("text" not in r and "heads" not in r for r in requests), requests
    assert page.evaluate("() => window.__attnlens.store.state.att.tokens.map(t => t.id)") == prompt_ids + gen_ids
    chips.nth(min(2, n - 1)).click()
    wait_rendered(page, before, prefix="gen:")
    assert f"step {min(2, n - 1) + 1} /" in page.inner_text("#gen-step-text")
    assert page.locator("#view-host .heatmap-base").count() == 1
    screenshot(page, "browser-generated.png")


def test_generation_ending_in_a_partial_character_is_analysed_by_its_ids(page, server, tiny_checkpoint):
    """A generation can stop inside a UTF-8 character: its text then ends in U+FFFD, which
    re-tokenises differently. The page must analyse the generated ids, not the text."""
    from attnlens.model import load_checkpoint

    tok = load_checkpoint(tiny_checkpoint).tokenizer
    prompt = "Café "
    prompt_ids = tok.encode(prompt)
    gen_ids = tok.encode("東京")[:4]  # 東 (3 one-byte tokens) and the first byte of 京
    text = tok.decode(gen_ids)
    assert text.endswith("\ufffd") and tok.encode(prompt + text) != prompt_ids + gen_ids
    decoder = __import__("codecs").getincrementaldecoder("utf-8")(errors="replace")
    events = []
    for i, t in enumerate(gen_ids):
        events.append(("token", {"index": i, "id": t, "text": tok.display_text(t), "delta": decoder.decode(tok.token_bytes(t)),
                                 "logprob": -1.0, "top_logprobs": []}))
    tail = decoder.decode(b"", final=True)
    events.append(("done", {"id": "gen-x", "finish_reason": "length",
                            "prompt_tokens": [{"id": i, "text": tok.display_text(i)} for i in prompt_ids],
                            "text": text, "delta": tail,
                            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(gen_ids),
                                      "total_tokens": len(prompt_ids) + len(gen_ids)},
                            "timings": {"queue_ms": 0, "prefill_ms": 1, "decode_ms": 1, "tokens_per_second": 100,
                                        "time_to_first_token_ms": 1}}))
    stream = "".join(f"event: {e}\ndata: {json.dumps(d, ensure_ascii=False)}\n\n" for e, d in events)
    open_page(page, server)
    page.route("**/generate", lambda route: route.fulfill(status=200, content_type="text/event-stream",
                                                          body=stream.encode()))
    requests = record_attention_requests(page)
    page.fill("#prompt", prompt)
    page.uncheck("#return_attention")
    before = rendered(page)
    page.click("#generate")
    page.wait_for_selector("#output[data-done]", state="attached")
    wait_rendered(page, before, prefix="head:")
    ids = prompt_ids + gen_ids
    assert [r.get("ids") for r in requests] == [ids], requests
    assert all("text" not in r for r in requests)
    assert page.evaluate("() => window.__attnlens.store.state.att.tokens.map(t => t.id)") == ids
    assert page.inner_text("#analysed").startswith(f"{len(ids)} tokens analysed")
    assert not page.locator("#messages .message").count()
    # the typed prompt is still analysed as text
    requests.clear()
    before = rendered(page)
    page.click("#analyse")
    wait_rendered(page, before)
    assert requests and all(r.get("text") == prompt and "ids" not in r for r in requests), requests


def test_head_view_pixels_change_with_the_head(page, server):
    open_page(page, server)
    first = canvas_digest(page)
    assert first["nonBlank"] > 1000 and first["colours"] > 10, first
    before = rendered(page)
    page.select_option("#head", "1")
    wait_rendered(page, before, prefix="head:0:1:")
    second = canvas_digest(page)
    assert second["colours"] > 10
    assert second["hash"] != first["hash"], "the heatmap did not change when another head was chosen"
    assert "head=1" in page.url


def test_model_view_thumbnail_selects_that_head(page, server):
    open_page(page, server, view="model")
    thumbs = page.locator("#view-host .thumb")
    meta = httpx.get(f"{server.base_url}/model").json()["architecture"]
    assert thumbs.count() == meta["n_layers"] * meta["n_heads"]
    before = rendered(page)
    page.click('#view-host .thumb[data-layer="1"][data-head="2"]')
    wait_rendered(page, before, prefix="head:1:2:")
    assert page.input_value("#layer") == "1"
    assert page.input_value("#head") == "2"
    assert page.eval_on_selector("#tab-head", "e => e.getAttribute('aria-selected')") == "true"
    assert "layer=1" in page.url and "head=2" in page.url


def test_hover_shows_query_key_and_weight(page, server):
    open_page(page, server)
    api = api_attention(server, PROMPT)
    tokens = api["tokens"]
    q, k = 5, 2
    point = page.evaluate(f"() => window.__attnlens.current().heatmap.cellCenter({q}, {k})")
    page.mouse.move(point["x"], point["y"])
    page.wait_for_selector("#tooltip:not([hidden])")
    tip = page.inner_text("#tooltip")
    assert f"“{visible(tokens[q]['text'])}” (#{q})" in tip
    assert f"“{visible(tokens[k]['text'])}” (#{k})" in tip
    assert tip.index(f"(#{q})") < tip.index("→") < tip.index(f"(#{k})")
    weight = float(tip.rsplit(":", 1)[1].split()[0])
    assert weight == pytest.approx(api["attention"][0][0][q][k], abs=1e-3)
    # hovering a token on the axis names that token
    label = page.evaluate(f"() => window.__attnlens.current().heatmap.labelCenter('row', {q})")
    page.mouse.move(label["x"], label["y"])
    page.wait_for_function(f"() => document.querySelector('#tooltip').innerText.includes('(#{q})')")
    assert "→" not in page.inner_text("#tooltip")


def test_bad_parameter_shows_an_error_message(page, server):
    open_page(page, server)
    page.fill("#temperature", "-1")
    page.click("#generate")
    msg = page.wait_for_selector("#messages .message")
    text = msg.inner_text()
    assert "temperature" in text and "greater than or equal to 0" in text
    assert page.get_attribute("#temperature", "aria-invalid") == "true"
    assert "Generate" in page.inner_text("#generate") and page.is_enabled("#generate")


def test_error_naming_a_field_marks_that_input(page, server):
    """A 400 names the field to fix in `param` (here the server's answer to a prompt over
    ATTNLENS_MAX_PROMPT_TOKENS); the page marks that input."""
    open_page(page, server)
    body = {"detail": "prompt has 2000 tokens, more than the limit of 1024 (ATTNLENS_MAX_PROMPT_TOKENS)",
            "param": "prompt", "code": "prompt_too_long"}
    page.route("**/generate", lambda route: route.fulfill(status=400, content_type="application/json",
                                                          body=json.dumps(body)))
    page.click("#generate")
    msg = page.wait_for_selector("#messages .message")
    assert "2000 tokens" in msg.inner_text()
    assert page.get_attribute("#prompt", "aria-invalid") == "true"
    assert page.get_attribute("#max_new_tokens", "aria-invalid") is None


def test_busy_and_unreachable_server_show_messages(page, server):
    open_page(page, server)
    page.route(
        "**/generate",
        lambda route: route.fulfill(status=429, headers={"Retry-After": "3", "Content-Type": "application/json"},
                                    body=json.dumps({"detail": "queue full"})),
    )
    page.click("#generate")
    msg = page.wait_for_selector("#messages .message")
    assert "try again in 3 s" in msg.inner_text()
    page.unroute("**/generate")
    page.route("**/attention", lambda route: route.abort())
    page.fill("#prompt", "a different text")
    page.click("#analyse")
    page.wait_for_function("() => document.querySelector('#messages').innerText.includes('Cannot reach')")


def test_url_carries_the_state(page, server):
    open_page(page, server, view="lines", layer="1", head="3", sink="1")
    assert page.eval_on_selector("#tab-lines", "e => e.getAttribute('aria-selected')") == "true"
    assert page.input_value("#layer") == "1" and page.input_value("#head") == "3"
    assert page.is_checked("#sink")
    assert page.input_value("#prompt") == PROMPT
    # every view draws (no errors) and the exports produce files
    for view in ("aggregate", "diff", "model", "head"):
        before = rendered(page)
        page.click(f'[role="tab"][data-view="{view}"]')
        wait_rendered(page, before, prefix=f"{view}:")
        assert f"view={view}" in page.url or view == "head"
    with page.expect_download() as dl:
        page.click("#export-png")
    assert dl.value.suggested_filename.endswith(".png")
    with page.expect_download() as dl:
        page.click("#export-json")
    data = json.loads(Path(dl.value.path()).read_text())
    assert len(data["matrix"]) == len(data["tokens"]) and data["first_token_sink_hidden"] is True


def test_dark_theme_toggle(page, server):
    open_page(page, server)
    light_bg = page.evaluate("getComputedStyle(document.body).backgroundColor")
    before = rendered(page)
    while page.evaluate("document.documentElement.dataset.theme") != "dark":
        page.click("#theme-toggle")
    wait_rendered(page, before)
    assert page.evaluate("getComputedStyle(document.body).backgroundColor") != light_bg
    screenshot(page, "browser-head-view-dark.png")


def test_model_view_of_256_tokens_draws_under_a_second(browser, long_server, long_text):
    """6 layers × 8 heads over 256 tokens: time the drawing of all 48 maps."""
    text = long_text(256)
    assert len(long_text.tokenizer.encode(text)) >= 250
    context = browser.new_context(viewport=DESKTOP)
    pg = context.new_page()
    try:
        pg.goto(f"{long_server.base_url}/?{urllib.parse.urlencode({'prompt': text, 'view': 'model'})}")
        pg.wait_for_function(
            "() => window.__attnlens.perf.modelView && window.__attnlens.perf.modelView.totalMs != null",
            timeout=60_000,
        )
        perf = pg.evaluate("window.__attnlens.perf.modelView")
        screenshot(pg, "browser-model-view-256.png")
    finally:
        context.close()
    print(f"\nmodel view, {perf['T']} tokens x {perf['layers']} layers x {perf['heads']} heads: "
          f"draw {perf['drawMs']:.0f} ms, with fetching {perf['totalMs']:.0f} ms")
    (ARTIFACTS / "model-view-perf.json").write_text(json.dumps(perf, indent=1))
    assert perf["T"] >= 250 and perf["layers"] == 6 and perf["heads"] == 8
    assert perf["drawMs"] < 1000


def test_api_key_is_asked_for_on_401_and_sent(page, server):
    """A server with an API key answers 401 without `Authorization: Bearer <key>`: the page
    offers to enter the key, keeps it in localStorage and sends it on every request."""
    seen = []

    def guard(route, request):
        auth = request.headers.get("authorization")
        seen.append((request.url.rsplit("/", 1)[-1], auth))
        if auth != "Bearer s3cret":
            return route.fulfill(status=401, headers={"WWW-Authenticate": "Bearer", "Content-Type": "application/json"},
                                 body=json.dumps({"detail": "missing or wrong API key (ATTNLENS_API_KEY)", "code": "invalid_api_key"}))
        return route.continue_()

    for path in ("**/model", "**/attention", "**/generate"):
        page.route(path, guard)
    page.goto(f"{server.base_url}/?{urllib.parse.urlencode({'prompt': PROMPT, 'layer': '1'})}")
    btn = page.wait_for_selector("#messages .key-btn")
    assert "API key" in page.inner_text("#messages")
    page.once("dialog", lambda d: d.accept("s3cret"))
    btn.click()
    wait_rendered(page, prefix="head:1:0:")
    assert page.evaluate("localStorage.getItem('attnlens-api-key')") == "s3cret"
    assert ("model", "Bearer s3cret") in seen and ("attention", "Bearer s3cret") in seen
    assert not page.locator("#messages .message").count()
