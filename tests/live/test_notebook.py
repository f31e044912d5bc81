"""The example notebook (examples/attnlens_notebook.ipynb), run by nbclient against a real server,
exported to HTML by nbconvert and opened in Chromium with the network off: every attnlens view
draws, logs no error and sends no request."""

from __future__ import annotations

import os
import re

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

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
nbconvert = pytest.importorskip("nbconvert")

pytestmark = pytest.mark.slow

NOTEBOOK = REPO_ROOT / "examples" / "attnlens_notebook.ipynb"
VIEWS = 9  # attnlens.show outputs: model, head, lines, generation; fill-mask, encoder head; cross, align; the local head
BERTVIZ = 3  # head_view, model_view (a subset), the translator's head_view
# What nbconvert's page template (require.js, MathJax) and bertviz's outputs (require.js, then d3 and
# jQuery) load from their CDN: none of it is attnlens', and none of it can load with the network off.
THIRD_PARTY = re.compile(r"^https://cdnjs\.cloudflare\.com/ajax/libs/(require\.js|mathjax|d3|jquery)/")


@pytest.fixture(scope="module")
def executed(bundled_server, tmp_path_factory):
    """The notebook after nbclient ran it (in examples/, as a user would), and its HTML export."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    before = os.environ.get("ATTNLENS_URL")
    os.environ["ATTNLENS_URL"] = bundled_server.url  # the kernel inherits it: the notebook uses this server
    # the kernel of this very Python (ipykernel's own spec): no kernelspec installed elsewhere on
    # the machine can run the notebook with another interpreter
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[]))
    try:
        nbclient.NotebookClient(nb, km=km, timeout=300, resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    finally:
        if before is None:
            os.environ.pop("ATTNLENS_URL")
        else:
            os.environ["ATTNLENS_URL"] = before
    body, _ = nbconvert.HTMLExporter().from_notebook_node(nb)
    path = tmp_path_factory.mktemp("notebook") / "attnlens_notebook.html"
    path.write_text(body, encoding="utf-8")
    return nb, path


def outputs(nb, mime: str) -> list[str]:
    return [o["data"][mime] for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type in ("display_data", "execute_result") and mime in o.get("data", {})]


def test_the_notebook_runs_and_shows_every_view(executed):
    nb, _ = executed
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert errors == [], [f"{e['ename']}: {e['evalue']}" for e in errors]
    views = [h for h in outputs(nb, "text/html") if 'class="attnlens-view"' in h]
    assert len(views) == VIEWS
    assert all("srcdoc=" in v and "<script" not in v.split("srcdoc=")[0] for v in views)
    plain = "\n".join(outputs(nb, "text/plain"))
    assert "'encoder-decoder'" in plain and "(4, 8, 13, 13)" in plain  # the models, the decoder's maps
    assert "'cross': (3, 4," in plain  # the translator's three groups
    scripts = outputs(nb, "application/javascript")  # bertviz's views: its script with their parameters
    assert len(scripts) == BERTVIZ
    assert '"include_layers": [1, 3], "include_heads": [0, 5], "total_heads": 8' in scripts[1]


@pytest.mark.browser
@needs_chromium
def test_the_exported_notebook_draws_every_view_offline(executed):
    _, path = executed
    visit = Visit()

    def work(context):
        page = open_offline(context, path, visit)
        frames = view_frames(page)
        assert len(frames) == VIEWS
        for i, frame in enumerate(frames):
            wait_drawn(frame)
            state = frame_state(frame)
            assert_drawn(state, f"view {i}")
            assert state["canvases"] or state["probRows"], f"view {i} drew nothing"
        page.wait_for_load_state("load")

    in_browser(work)
    # attnlens' views (each frame's own errors were checked above): no request, no console error
    assert [r for r in visit.requests if r[1] == "about:srcdoc"] == []
    assert [e for e in visit.console_errors if e[1] == "about:srcdoc" or e[1].startswith("data:")] == []
    # everything that tried to leave the page is nbconvert's template's or bertviz's, from their CDN
    page_url = path.as_uri()
    leaving = [u for u, _ in visit.requests if u != page_url]
    assert leaving and all(THIRD_PARTY.match(u) for u in leaving), leaving
    assert all(THIRD_PARTY.match(src) and "ERR_" in text for text, src in visit.console_errors), visit.console_errors
    # and bertviz's scripts fail only for want of require.js (its loader, from the CDN)
    assert visit.page_errors == ["require is not defined"] * BERTVIZ, visit.page_errors
