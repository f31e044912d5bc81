"""PNG exports carry a title, token labels and a colour bar at a usable size; the URL carries
every state key both ways; the output panel's probability bar shows its ticks (issue 12)."""

from __future__ import annotations

import shutil
import urllib.parse

from PIL import Image

from .helpers import ARTIFACTS, PROMPT, api_attention, download, open_page, rendered, wait_rendered


def colour_bar_rows(img: Image.Image) -> int:
    """How many pixel rows look like a colour bar: a run of ≥ 150 distinct colours."""
    rgb = img.convert("RGB")
    w, h = rgb.size
    px = rgb.load()
    count = 0
    for y in range(h):
        if len({px[x, y] for x in range(0, w)}) >= 150:
            count += 1
    return count


def test_head_view_png_has_title_labels_and_colour_bar(page, server):
    open_page(page, server, prompt="Hi there", layer="1", head="2")
    path, name = download(page, "#export-png")
    assert name == "attnlens-L1H2.png"
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(path, ARTIFACTS / "export-head.png")
    img = Image.open(path)
    assert img.width >= 1200, img.size  # a short prompt is not a thumbnail
    assert "layer 1, head 2" in img.text["Title"] and "Head" in img.text["Title"]
    assert img.text["Title"].startswith(page.evaluate("() => window.__attnlens.store.state.meta.name"))
    assert "attention weight" in img.text["Description"]
    assert colour_bar_rows(img) >= 10, "no colour bar in the PNG"
    # the token labels are in it: the export is taller and wider than the bare grid
    L = page.evaluate("() => window.__attnlens.current().heatmap.layout")
    assert L["left"] > 20 and L["top"] > 20


def test_difference_png_says_which_colour_is_a_and_which_b(page, server):
    open_page(page, server, view="diff", layerB="1", headB="3")
    path, name = download(page, "#export-png")
    shutil.copy(path, ARTIFACTS / "export-difference.png")
    img = Image.open(path)
    assert img.width >= 1200
    assert "L0H0 − L1H3" in img.text["Title"]
    d = img.text["Description"]
    assert "A (L0H0) attends more" in d and "B (L1H3) attends more" in d
    assert colour_bar_rows(img) >= 10


def test_model_and_generation_exports_have_titles(page, server):
    open_page(page, server, view="model")
    path, _ = download(page, "#export-png")
    img = Image.open(path)
    assert img.width >= 1200 and "all 2 layers × 4 heads" in img.text["Title"]
    assert colour_bar_rows(img) >= 10


def test_url_round_trip_of_every_state_key(page, browser, server):
    open_page(page, server)
    prompt_ids = [t["id"] for t in api_attention(server, text=PROMPT)["tokens"]]
    gen_ids = [t["id"] for t in api_attention(server, text=" to be")["tokens"]]
    values = {
        "model": "tiny",
        "prompt": PROMPT,
        "source": "gen",
        "chat": True,
        "ids": prompt_ids + gen_ids,
        "plen": len(prompt_ids),
        "view": "diff",
        "layer": 1,
        "head": 3,
        "pin": [5, 2],
        "step": 1,
        "sink": True,
        "cmap": "magma",
        "dcmap": "berlin",
        "scale": "sqrt",
        "zoom": 1.5625,
        "op": "max",
        "layers": [1],
        "heads": [0, 2],
        "diff": "prompts",
        "layerB": 1,
        "headB": 2,
        "promptB": "B text,\nsecond line & more",
        "fillk": 7,
        "xavg": "layer",
        "lheads": [3, 1],
        "ablate": "1.2z,0.3m",
        "explain": 2,
        "probe": True,
        "lensat": 3,
        "morder": "induction",
        "win": [8, 40, 0, 32],
        "clean": "A clean prompt, with & and =",
        "corrupted": "A corrupted prompt, with & and =",
        "answer": " Paris",
        "foil": " Rome",
        "ctarget": "A target, with & and =",
        "method": "attribution",
        "component": "residual",
        "sender": [1, 2],
        "probs": [120, 998],
        "max_new_tokens": "40",
        "temperature": "0.5",
        "top_k": "20",
        "top_p": "0.9",
        "seed": "7",
        "logprobs": "3",
        "stop": "\\n\\n, THE END",
        "return_attention": False,
    }
    url_keys = page.evaluate("window.__attnlens.urlKeys")
    assert sorted(values) == sorted(url_keys), "a state key the link carries is not covered by this test"
    r = rendered(page)
    page.evaluate("(v) => window.__attnlens.store.set(v)", values)
    wait_rendered(page, r)
    url = page.url
    q = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
    assert set(q) == set(values), set(values) ^ set(q)
    other = browser.new_context(viewport={"width": 1280, "height": 900})
    try:
        pg = other.new_page()
        pg.goto(url)
        wait_rendered(pg, prefix="diff:1:3:")
        got = pg.evaluate("(keys) => Object.fromEntries(keys.map(k => [k, window.__attnlens.store.state[k]]))", url_keys)
        assert got == values
        assert pg.url == url
        # the controls show it
        assert pg.input_value("#layer") == "1" and pg.input_value("#head") == "3"
        assert pg.input_value("#cmap") == "magma" and pg.input_value("#dcmap") == "berlin"
        assert pg.input_value("#scale") == "sqrt" and pg.input_value("#op") == "max"
        assert pg.is_checked("#sink") and pg.is_checked('input[name="diff"][value="prompts"]')
        assert pg.input_value("#promptB") == values["promptB"]
        assert pg.inner_text("#zoom-level") == "156%"
        # the sampling form shows the link's settings
        for field in ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "logprobs", "stop"):
            assert pg.input_value(f"#{field}") == values[field], field
        assert not pg.is_checked("#return_attention")
    finally:
        other.close()
    # defaults are left out of the URL
    open_page(page, server)
    assert set(urllib.parse.parse_qs(urllib.parse.urlsplit(page.url).query)) == {"prompt"}


def test_probability_bar_shows_its_ticks(page, server):
    open_page(page, server)
    bar = page.locator(".prob-bar").bounding_box()
    zero = page.locator(".prob-ticks .tick-0").bounding_box()
    one = page.locator(".prob-ticks .tick-1").bounding_box()
    assert zero and one and zero["width"] > 0 and one["width"] > 0
    assert abs(zero["x"] - bar["x"]) < 3 and abs(one["x"] + one["width"] - (bar["x"] + bar["width"])) < 3
    assert zero["y"] >= bar["y"] + bar["height"] - 1
    assert page.inner_text(".prob-ticks").split() == ["0", "0.5", "1"]
