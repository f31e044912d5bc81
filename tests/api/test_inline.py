"""attnlens.show: the page's own view modules bundled into one document per view, drawn from
the embedded answer in Chromium with the network off, for every view of every family."""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO_ROOT
from notebook_browser import (
    Visit,
    assert_drawn,
    frame_state,
    in_browser,
    needs_chromium,
    open_offline,
    view_frames,
    wait_drawn,
)

import attnlens
from attnlens import local
from attnlens.bundle import SPECIFIER, bundle, module_graph
from attnlens.inline import inline_views, page_views
from attnlens.resources import static_dir

CKPT = REPO_ROOT / "checkpoints"
TEXTS = {"default": "To be, or not to be, that is the question:", "encoder": "O Romeo, Romeo, [MASK] art thou?",
         "translator": "ninety-seven"}


@pytest.fixture(scope="module")
def answers():
    return {name: local.attention(text, CKPT / name) for name, text in TEXTS.items()}


def generation_of(answer: attnlens.Attention, prompt: int) -> attnlens.Generation:
    """A generation as the server would report it with return_attention, made from an analysis of
    the same tokens (as the page rebuilds one from a link): step s's row is the attention of the
    position that produced token s (a translator's: its decoder step's cross-attention row)."""
    from attnlens.answers import GeneratedToken, Timings, Usage

    cross = "target" in answer.axes()  # its steps read the prompt as a source (a translator)
    if cross:
        prompt_tokens, generated = answer.tokens, answer.target_tokens[1:]
        rows = [answer.cross.maps[:, :, s, :] for s in range(len(generated))]
        attention = [answer.decoder.maps[:, :, s, : s + 1] for s in range(len(generated))]
    else:
        prompt_tokens, generated = answer.tokens[:prompt], answer.tokens[prompt:]
        rows = attention = [answer.maps[:, :, prompt + s - 1, : prompt + s] for s in range(len(generated))]
    tokens = [GeneratedToken(t.id, t.text, -0.5, [], s, t.text, attention[s], rows[s] if cross else None)
              for s, t in enumerate(generated)]
    n = len(tokens)
    return attnlens.Generation("gen-1", answer.model, "".join(t.text for t in generated), prompt_tokens, tokens,
                               "length", Usage(len(prompt_tokens), n, len(prompt_tokens) + n), Timings(0, 0, 0, 0, 0))


def module_source(data_url: str) -> str:
    return base64.b64decode(data_url.removeprefix("data:text/javascript;base64,")).decode()


# --- the bundle ---------------------------------------------------------------------------------
def test_the_bundle_is_the_pages_own_modules_linked_by_an_import_map():
    b = bundle()
    js = static_dir() / "js"
    graph = module_graph(js)
    assert b.entry == "attnlens/inline.js" and set(b.modules) == {f"attnlens/{m}" for m in graph}
    for needed in ("views/headview.js", "views/modelview.js", "views/lineview.js", "translator/crossview.js",
                   "heatmap.js", "views/registry.js"):
        assert f"attnlens/{needed}" in b.modules
    for name, url in b.import_map["imports"].items():
        assert url.startswith("data:text/javascript;base64,")
        source = module_source(url)
        assert not SPECIFIER.search(source), f"{name} still has a relative import"
        for imported in re.findall(r'(?:from|import)\s*\(?\s*"(attnlens/[^"]+)"', source):
            assert imported in b.import_map["imports"], f"{name} imports {imported}, which is not in the bundle"
        # the page's file, byte for byte, but for its import specifiers
        original = (js / name.removeprefix("attnlens/")).read_text(encoding="utf-8")
        assert re.sub(r'"attnlens/[^"]+"', '""', source) == re.sub(r'"\.{1,2}/[^"]+"', '""', original)


def test_the_views_are_the_registrys_analysis_views(answers):
    views = page_views()
    assert {"head", "model", "lines", "cross", "gen"} <= set(views)
    assert views["cross"]["needs"] == ["cross"] and views["gen"]["needs"] == ["generation"]
    assert inline_views(answers["default"]) == ["head", "model", "aggregate", "diff", "lines"]
    assert inline_views(answers["encoder"]) == ["head", "model", "aggregate", "diff", "lines"]
    assert inline_views(answers["translator"]) == ["head", "model", "aggregate", "diff", "lines", "cross", "align",
                                                   "decoder"]
    assert inline_views(generation_of(answers["default"], 4)) == ["gen"]
    assert inline_views(generation_of(answers["translator"], 4)) == ["gen"]


# --- show() ---------------------------------------------------------------------------------------
def test_show_checks_what_it_is_asked(answers):
    a = answers["default"]
    with pytest.raises(ValueError, match="'cross' is not one this attention answer has"):
        attnlens.show(a, view="cross")
    with pytest.raises(ValueError, match="'gen'"):
        attnlens.show(a, view="gen")
    sub = local.attention(TEXTS["default"], CKPT / "default", layers=[1], heads=[2, 3])
    with pytest.raises(ValueError, match=r"layer 0 is not in this answer: it holds layers \[1\]"):
        attnlens.show(sub, layer=0)
    with pytest.raises(TypeError, match="unknown option"):
        attnlens.show(a, colour="red")
    with pytest.raises(TypeError, match="either an answer or text"):
        attnlens.show(a, text="To be")
    with pytest.raises(TypeError, match="draws an Attention"):
        attnlens.show({"tokens": []})
    gen = generation_of(a, 4)
    with pytest.raises(ValueError, match="'head' is not one this generation has here"):
        attnlens.show(gen, view="head")
    bare = attnlens.Generation(gen.id, gen.model, gen.text, gen.prompt_tokens,
                               [attnlens.GeneratedToken(t.id, t.text, t.logprob) for t in gen.tokens],
                               gen.finish_reason, gen.usage, gen.timings)
    with pytest.raises(ValueError, match="return_attention=True"):
        attnlens.show(bare)


def test_repr_html_is_an_iframe_that_holds_everything(answers):
    view = attnlens.show(answers["default"], view="model", cmap="magma")
    one, two = view._repr_html_(), view._repr_html_()
    ids = [re.search(r'<iframe id="([^"]+)"', h).group(1) for h in (one, two)]
    assert ids[0] != ids[1]  # every display its own frame
    doc = html.unescape(re.search(r'srcdoc="([^"]*)"', one).group(1))
    assert doc == view.html()
    assert not re.search(r'\b(?:src|href)\s*=\s*["\']?(?:https?:)?//', doc)  # nothing to load from elsewhere
    spec = re.search(r'<script type="application/json" id="attnlens-spec">(.*?)</script>', doc, re.S).group(1)
    assert '"view":"model"' in spec and '"cmap":"magma"' in spec and "</" not in spec


def test_show_text_runs_the_checkpoint_here(answers):
    view = attnlens.show(text=TEXTS["default"], model=CKPT / "default", view="lines", layer=1, head=2)
    embedded = attnlens.Attention.from_json(view.spec["answer"])
    np.testing.assert_allclose(embedded.maps, answers["default"].maps, atol=2.5e-4)  # embedded as f16
    assert view.spec["state"] == {"layer": 1, "head": 2} and view.spec["view"] == "lines"


# --- in the browser, offline ----------------------------------------------------------------------
def write_page(tmp_path, name: str, views: list) -> "Path":
    """A page holding `views` as Jupyter shows them (their _repr_html_), like an exported notebook."""
    path = tmp_path / f"{name}.html"
    path.write_text("<!doctype html><meta charset=utf-8><body>" + "".join(v._repr_html_() for v in views) + "</body>")
    return path


def no_request_left(visit: Visit, page_url: str) -> None:
    assert [u for u, _ in visit.requests if u != page_url] == [], visit.requests
    assert visit.console_errors == [] and visit.page_errors == [], (visit.console_errors, visit.page_errors)


@pytest.mark.browser
@needs_chromium
@pytest.mark.parametrize("family", ["default", "encoder", "translator"])
def test_every_view_draws_offline(tmp_path, answers, family):
    a = answers[family]
    views = [attnlens.show(a, view=v, layer=a.layers[-1], head=a.heads[-1]) for v in inline_views(a)]
    if family != "encoder":  # what each generated token attended to
        views.append(attnlens.show(generation_of(a, 4), layer=1, head=2, step=2))
    if family == "encoder":
        from attnlens.answers import Classification, FillMask, FillMaskCandidate, LabelScore

        views.append(attnlens.show(FillMask("encoder", "The [MASK] of Denmark",
                                            [[FillMaskCandidate(0.5, 7, " king", "The king of Denmark"),
                                              FillMaskCandidate(0.25, 8, " prince", "The prince of Denmark")]])))
        views.append(attnlens.show(Classification("encoder", "O Romeo", [LabelScore("tragedy", 0.9),
                                                                         LabelScore("comedy", 0.1)])))
    path = write_page(tmp_path, family, views)
    visit = Visit()

    def work(context):
        page = open_offline(context, path, visit)
        frames = view_frames(page)
        assert len(frames) == len(views)
        for view, frame in zip(views, frames):
            wait_drawn(frame)
            state = frame_state(frame)
            assert_drawn(state, view.title)
            if view.spec["kind"] in ("attention", "generation"):
                assert state["rendered"].startswith(f"{view.spec['view']}:"), state["rendered"]
                assert state["canvases"], view.title  # something was drawn on a canvas
            else:
                assert state["probRows"] == len(view.spec.get("labels") or view.spec["masks"][0])
            height = frame.frame_element().evaluate("e => e.getBoundingClientRect().height")
            content = frame.evaluate("() => document.documentElement.getBoundingClientRect().height")
            assert abs(height - content) <= 4, (view.title, height, content)  # the iframe fits its view

    in_browser(work)
    no_request_left(visit, path.as_uri())


@pytest.mark.browser
@needs_chromium
def test_two_views_in_one_page_keep_their_own_state_and_follow_clicks(tmp_path, answers):
    a = answers["default"]
    path = write_page(tmp_path, "two", [attnlens.show(a, view="model"), attnlens.show(a, view="head", layer=0, head=0)])
    visit = Visit()

    def work(context):
        page = open_offline(context, path, visit)
        model, head = view_frames(page)
        for f in (model, head):
            wait_drawn(f)
        # the second view's layer menu draws layer 2 there, and only there
        head.select_option("select[data-key='layer']", "2")
        head.wait_for_function("() => document.querySelector('.view-host').dataset.rendered.startsWith('head:2:0:')")
        assert "Layer 2 · head 0" in frame_state(head)["caption"]
        assert frame_state(model)["rendered"].startswith("model:")
        # a click on a map of the model view opens that head in the same frame's head view
        model.click(".thumb[data-layer='3'][data-head='5']")
        model.wait_for_function("() => document.querySelector('.view-host').dataset.rendered.startsWith('head:3:5:')")
        state = frame_state(model)
        assert_drawn(state, "model -> head")
        assert "Layer 3 · head 5" in state["caption"]
        assert frame_state(head)["rendered"].startswith("head:2:0:")

    in_browser(work)
    no_request_left(visit, path.as_uri())


@pytest.mark.browser
@needs_chromium
def test_a_pooled_answer_draws_offline_in_the_model_view(tmp_path):
    """show() of an answer made with pool=N (a long input's overview) draws every head's grid in
    the model view (NaN for the heads it does not hold); a top-k or windowed answer is refused
    with what to read instead."""
    text = TEXTS["default"] * 3
    pooled = local.attention(text, CKPT / "default", pool=8, layers=[0, 3])
    view = attnlens.show(pooled)
    assert view.spec["view"] == "model" and view.spec["answer"]["row_edges"][-1] == len(pooled.tokens)
    with pytest.raises(ValueError, match="drawn in the model view"):
        attnlens.show(pooled, view="head")
    for reduced, what in ((dict(top_k=3), "top-k"), (dict(rows=(2, 6)), "window")):
        with pytest.raises(ValueError, match=what):
            attnlens.show(local.attention(text, CKPT / "default", **reduced))
    path = write_page(tmp_path, "pooled", [view])
    visit = Visit()

    def work(context):
        page = open_offline(context, path, visit)
        frame = view_frames(page)[0]
        wait_drawn(frame)
        state = frame_state(frame)
        assert state["rendered"].startswith("model:") and state["canvases"]
        assert frame.evaluate("() => document.querySelectorAll('.thumb:not(.loading)').length") == 32
        assert frame.evaluate("() => document.querySelectorAll('.model-order').length") == 0  # no server to score

    in_browser(work)
    no_request_left(visit, path.as_uri())
