"""A mixture of experts in the page (issue 47): the logit lens of a served Mixtral (small and random,
as transformers builds it, imported) names in each block's cell the expert that block routed the
position to with the most weight, and its tooltip lists every chosen expert with its weight; each
checked against the API's own answer."""

from __future__ import annotations

import httpx
import pytest
from live_server import live_server

from .helpers import download
from .test_explain_views import analyse, api, open_tab

pytest.importorskip("transformers")

TEXT = "the cat sat on the mat and the dog ran to the park"


@pytest.fixture(scope="module")
def mixtral_server(tmp_path_factory):
    from arch_helpers import MORE_CASES, write_hf_checkpoint

    from attnlens.model.interop.convert import import_checkpoint

    root = tmp_path_factory.mktemp("mixtral")
    src, _ = write_hf_checkpoint(MORE_CASES["mixtral"], root / "hf", seed=3)
    ours, _ = import_checkpoint(src, root / "mixtral")
    with live_server(ours, root) as server:
        yield server


def test_the_lens_names_each_blocks_expert_and_lists_them_on_hover(page, mixtral_server):
    model = httpx.get(f"{mixtral_server.base_url}/models", timeout=30).json()["default"]
    analyse(page, mixtral_server, TEXT, model=model)
    open_tab(page, "lens")
    want = api(mixtral_server, "/lens", {"model": model, "text": TEXT, "top_k": 5, "rank": True})
    for layer in want["layers"]:  # the page reads the last 16 positions
        layer["positions"] = layer["positions"][-16:]
    marks = page.eval_on_selector_all(
        ".lens-grid tbody tr",
        "trs => trs.map(tr => [...tr.querySelectorAll('td')].map(td => td.querySelector('.lens-expert')?.dataset.expert ?? null))")
    assert len(marks) == len(want["layers"]) > 1
    assert all(m is None for m in marks[0])  # the embeddings: no block, no experts
    for row, layer in zip(marks[1:], want["layers"][1:]):
        assert row == [str(p["experts"][0]["expert"]) for p in layer["positions"]]
    assert "mixture of experts" in page.inner_text("#caption")
    page.locator(".lens-grid td[data-layer='2'][data-pos='3']").hover()
    tip = page.inner_text("#tooltip")
    experts = want["layers"][2]["positions"][3]["experts"]
    assert len(experts) == 2 and all(f"E{e['expert']} " in tip for e in experts), tip
    path, name = download(page, "#export-png")
    assert name == "attnlens-lens.png" and path.stat().st_size > 1000
