"""A 2,048-token prompt in the page (issue 32): typed in, the model view draws every head from one
pooled request, a click opens a head pooled to the screen, zooming fetches windows until every
token is there with its label. Counts the /attention bytes the page fetched (the model view: at
most 8 MB) and its errors (none), and that no request asked for whole maps. A random decoder with
a 4,096-token context (4 layers x 8 heads) keeps the server's side fast."""

from __future__ import annotations

import pytest
from conftest import TINY_TEXT, make_tiny_checkpoint
from live_server import live_server

from .helpers import rendered, screenshot, state, wait_rendered

T = 2048
MODEL_VIEW_BYTES = 8_000_000


@pytest.fixture(scope="module")
def long_context(tmp_path_factory):
    from attnlens.model import load_checkpoint

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ctx4k") / "long4k", context_length=4096, n_layers=4,
                                n_heads=8, d_model=64, d_ff=128)
    tok = load_checkpoint(path).tokenizer
    text = tok.decode(tok.encode(TINY_TEXT * 40)[:T])
    while len(tok.encode(text)) > T:
        text = text[:-1]
    with live_server(path, tmp_path_factory.mktemp("long4k-logs")) as srv:
        yield srv, text, len(tok.encode(text))


def test_a_2048_token_prompt_in_the_model_and_head_views(page, long_context):
    server, text, n = long_context
    assert n > 2000
    fetched: list[tuple[dict, int]] = []  # (request body, response bytes)

    def on_response(response):
        body = response.request.post_data_json if response.request.method == "POST" else None
        if response.url.endswith("/attention") and body and body.get("text") == text:  # not the opening example's
            fetched.append((body, len(response.body())))

    page.on("response", on_response)
    page.goto(f"{server.base_url}/?view=model")
    r = wait_rendered(page)
    page.fill("#prompt", text)
    page.click("#analyse")
    page.wait_for_function("(n) => window.__attnlens.store.state.att?.T === n", arg=n)
    wait_rendered(page, r, prefix="model:")
    page.wait_for_function("() => document.querySelectorAll('#view-host .thumb:not(.loading)').length === 32")
    model_bytes = sum(b for _, b in fetched)
    perf = page.evaluate("() => window.__attnlens.perf.modelView")
    assert state(page, "s.att.long") is True
    assert model_bytes <= MODEL_VIEW_BYTES, model_bytes
    assert "pooled" in page.inner_text("#analysed")
    screenshot(page, "long-prompt-model.png")

    # a click opens the head, pooled to the screen
    r = rendered(page)
    page.click("#view-host .thumb[data-layer='2'][data-head='3']")
    wait_rendered(page, r, prefix="head:")
    head = page.evaluate("() => window.__attnlens.perf.longHead")
    assert head["pooled"] and head["nr"] < n and head["window"] == [0, n, 0, n]

    # the wheel zooms in at the pointer: windows at full resolution, then labelled tokens
    for _ in range(12):
        if page.evaluate("() => window.__attnlens.perf.longHead.labels"):
            break
        r = rendered(page)
        canvas = page.locator("#view-host .long-head-canvas")
        canvas.scroll_into_view_if_needed()
        box = canvas.bounding_box()
        page.mouse.move(box["x"] + box["width"] * 0.7, box["y"] + box["height"] * 0.7)
        page.mouse.wheel(0, -200)
        wait_rendered(page, r, prefix="head:")
    head = page.evaluate("() => window.__attnlens.perf.longHead")
    assert head["labels"] and not head["pooled"], head
    win = state(page, "s.win")
    assert win and win[1] - win[0] <= 96 and win[1] <= n
    assert f"win={','.join(map(str, win))}".replace(",", "%2C") in page.url or "win=" in page.url
    screenshot(page, "long-prompt-head-zoomed.png")

    # a drag pans the window
    r = rendered(page)
    box = page.locator("#view-host .long-head-canvas").bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.6, box["y"] + box["height"] * 0.6)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.75, box["y"] + box["height"] * 0.75, steps=4)
    page.mouse.up()
    wait_rendered(page, r, prefix="head:")
    assert state(page, "s.win") != win

    bodies = [body for body, _ in fetched]
    assert all(b.get("pool") or b.get("rows") for b in bodies), bodies  # never a whole map
    total = sum(b for _, b in fetched)
    errors = page.console_log.errors
    assert not errors, errors
    print(f"\n{n} tokens: model view {model_bytes / 1e6:.2f} MB in {len(fetched)} requests so far; all "
          f"{total / 1e6:.2f} MB; model view drawn in {perf['drawMs']:.0f} ms, the zoomed head in "
          f"{head['drawMs']:.0f} ms")


def test_the_heads_in_the_order_of_an_atlas_score_or_grouped_by_role(page, long_context):
    server, text, n = long_context
    page.goto(f"{server.base_url}/?view=model&morder=induction")
    r = wait_rendered(page)
    page.fill("#prompt", text)
    page.click("#analyse")
    page.wait_for_function("(n) => window.__attnlens.store.state.att?.T === n", arg=n)
    page.wait_for_function("() => document.querySelectorAll('#view-host figure.thumb-item').length === 32")
    captions = page.eval_on_selector_all("#view-host figure.thumb-item figcaption", "cs => cs.map(c => c.textContent)")
    scores = [float(c.split()[-1]) for c in captions if c.split()[-1] != "—"]
    assert scores == sorted(scores, reverse=True) and len(scores) == 32
    assert page.eval_on_selector(".model-order select", "s => s.value") == "induction"
    r = rendered(page)
    page.select_option(".model-order select", "role")
    wait_rendered(page, r, prefix="model:")
    headings = page.eval_on_selector_all("#view-host .role-heading", "hs => hs.map(h => h.textContent)")
    assert headings and sum(int(h.split(" · ")[1].split()[0]) for h in headings) == 32, headings
    assert "morder=role" in page.url
    r = rendered(page)
    page.select_option(".model-order select", "grid")
    wait_rendered(page, r, prefix="model:")
    assert page.locator("#view-host figure.thumb-item").count() == 0
    assert not page.console_log.errors
