"""Helpers for the browser tests: opening the page, waiting for a view to draw, reading
canvas pixels, screenshots, recording requests, and a /generate stream the test controls."""

from __future__ import annotations

import json
import urllib.parse
from pathlib import Path

import httpx
from conftest import REPO_ROOT

ARTIFACTS = REPO_ROOT / "test-artifacts"
# At most 64 UTF-8 bytes, so the page asks for format=json and the numbers match the API's exactly.
PROMPT = "To be, or not to be, that is the question:\nWhether"


def visible(text: str) -> str:
    """What the page shows for a token: whitespace as ␣ ↵ ⇥ (static/js/tokens.js)."""
    return text.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥").replace("\r", "␍") or "∅"


def open_page(page, server, **query) -> None:
    q = {"prompt": PROMPT, **query}
    page.goto(f"{server.base_url}/?{urllib.parse.urlencode(q)}")
    wait_rendered(page)


def rendered(page) -> str:
    return page.eval_on_selector("#view-host", "e => e.dataset.rendered || ''")


def wait_rendered(page, previous: str | None = None, prefix: str = "") -> str:
    """Wait until the view has finished drawing (after `previous`, starting with `prefix`)."""
    page.wait_for_function(
        """([prev, prefix]) => {
            const r = document.querySelector('#view-host')?.dataset.rendered || '';  // null while a reload swaps the document
            return r && r !== prev && r.startsWith(prefix) && !document.documentElement.hasAttribute('data-busy');
        }""",
        arg=[previous or "", prefix],
    )
    return rendered(page)


def state(page, expr: str = "s"):
    """Evaluate `expr` on the store's state `s` (JSON-able results only)."""
    return page.evaluate(f"() => {{ const s = window.__attnlens.store.state; return {expr}; }}")


def canvas_digest(page, selector: str = "#view-host .heatmap-base") -> dict:
    """Hash and colour count of a canvas's pixels ({} when it is absent or hidden)."""
    return page.evaluate(
        """(sel) => {
            const c = document.querySelector(sel);
            if (!c || !c.offsetParent) return {};
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let h = 2166136261 >>> 0, nonBlank = 0;
            const colours = new Set();
            for (let i = 0; i < d.length; i += 4) {
                if (d[i + 3] === 0) continue;
                nonBlank++;
                const v = (d[i] << 16) | (d[i + 1] << 8) | d[i + 2];
                colours.add(v);
                h = Math.imul(h ^ v, 16777619) >>> 0;
            }
            return {hash: h, nonBlank, colours: colours.size, w: c.width, h: c.height};
        }""",
        selector,
    )


def screenshot(page, name: str, full_page: bool = True) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=full_page)
    return path


def record_attention_requests(page) -> list[dict]:
    """The JSON bodies of the page's /attention requests from now on (filled in as they go)."""
    bodies: list[dict] = []

    def on_request(request):
        if request.url.endswith("/attention") and request.method == "POST":
            bodies.append(json.loads(request.post_data or "null"))

    page.on("request", on_request)
    return bodies


def api_attention(server, text: str | None = None, ids: list[int] | None = None) -> dict:
    body = {"format": "json", **({"text": text} if text is not None else {"ids": ids})}
    r = httpx.post(f"{server.base_url}/attention", json=body, timeout=60)
    r.raise_for_status()
    return r.json()


def download(page, selector: str):
    """Click `selector` and return the path of the file it downloads."""
    with page.expect_download() as dl:
        page.click(selector)
    return Path(dl.value.path()), dl.value.suggested_filename


CONTROLLED_STREAM = """() => {
    // /generate answers with a stream the test feeds: window.__feed(event, data), __end().
    const real = window.fetch;
    window.fetch = (url, opts) => {
        if (!String(url).endsWith('/generate')) return real(url, opts);
        const enc = new TextEncoder();
        let ctl;
        const body = new ReadableStream({ start(c) { ctl = c; } });
        window.__feed = (event, data) => ctl.enqueue(enc.encode(`event: ${event}\\ndata: ${JSON.stringify(data)}\\n\\n`));
        window.__end = () => ctl.close();
        window.__generateBody = JSON.parse(opts.body);
        return Promise.resolve(new Response(body, { status: 200, headers: { 'Content-Type': 'text/event-stream' } }));
    };
}"""


def control_generate_stream(page) -> None:
    """From now on the page's /generate gets a stream that feed_stream() writes to."""
    page.evaluate(CONTROLLED_STREAM)


def feed_stream(page, event: str, data: dict) -> None:
    page.wait_for_function("() => typeof window.__feed === 'function'")
    page.evaluate("([e, d]) => window.__feed(e, d)", [event, data])


def end_stream(page) -> None:
    page.evaluate("() => window.__end()")


def overflow(page) -> dict:
    """How far the document reaches past the viewport, and the widest offending elements."""
    return page.evaluate(
        """() => {
            const vw = document.documentElement.clientWidth;
            const wide = [];
            for (const el of document.querySelectorAll('body *')) {
                const r = el.getBoundingClientRect();
                if (r.width && r.right > vw + 1 && !el.closest('.view-host, .tabs, .gen-heat, .line-scroller')) wide.push(`${el.tagName}.${el.className}#${el.id} ${Math.round(r.right)}`);
            }
            return {scrollWidth: document.documentElement.scrollWidth, viewport: vw, wide: wide.slice(0, 8)};
        }"""
    )


def spill(page) -> dict:
    """Everything that reaches past the right edge of the viewport and can be seen there: the
    document's own width, and each element whose box ends right of the viewport unless an
    ancestor that scrolls or clips (overflow other than visible) keeps it inside itself."""
    return page.evaluate(
        """() => {
            const vw = document.documentElement.clientWidth;
            const clipped = (el) => {
                for (let a = el.parentElement; a && a !== document.body; a = a.parentElement) {
                    const s = getComputedStyle(a);
                    if (s.overflowX !== 'visible' && a.getBoundingClientRect().right <= vw + 1) return true;
                }
                return false;
            };
            const out = [];
            for (const el of document.querySelectorAll('body *')) {
                const r = el.getBoundingClientRect();
                if (!r.width || r.right <= vw + 1 || getComputedStyle(el).visibility === 'hidden') continue;
                if (!clipped(el)) out.push(`${el.tagName.toLowerCase()}${el.id ? '#' + el.id : ''}.${String(el.className).split(' ')[0]} right=${Math.round(r.right)}`);
            }
            return {viewport: vw, scrollWidth: Math.max(document.documentElement.scrollWidth, document.body.scrollWidth), wide: out.slice(0, 8)};
        }"""
    )


def generation_events(server, prompt: str, gen_ids: list[int], *, record: bool = True) -> list[tuple[str, dict]]:
    """SSE events of a generation of `gen_ids` after `prompt`, as /generate streams them, with
    each token's attention row taken from /attention over the same ids (so the page's two
    routes to the same numbers can be compared)."""
    prompt_tokens = api_attention(server, text=prompt)["tokens"]
    ids = [t["id"] for t in prompt_tokens] + gen_ids
    full = api_attention(server, ids=ids)
    P = len(prompt_tokens)
    events = []
    for i, tid in enumerate(gen_ids):
        q = P + i - 1
        tok = full["tokens"][P + i]
        data = {"index": i, "id": tid, "text": tok["text"], "delta": tok["text"], "logprob": -0.5,
                "top_logprobs": [{"id": tid, "text": tok["text"], "logprob": -0.5}]}
        if record:
            data["attention"] = [[head[q][: q + 1] for head in layer] for layer in full["attention"]]
        events.append(("token", data))
    text = "".join(full["tokens"][P + i]["text"] for i in range(len(gen_ids)))
    events.append(("done", {"id": "gen-test", "finish_reason": "length", "prompt_tokens": prompt_tokens, "text": text,
                            "delta": "", "usage": {"prompt_tokens": P, "completion_tokens": len(gen_ids),
                                                   "total_tokens": P + len(gen_ids)},
                            "timings": {"queue_ms": 0, "prefill_ms": 1, "decode_ms": 1, "tokens_per_second": 100,
                                        "time_to_first_token_ms": 1}}))
    return events


def generate_with(page, events, *, record: bool = True, finish: bool = True) -> None:
    """Click Generate and feed the page `events` through a controlled stream."""
    control_generate_stream(page)
    page.set_checked("#return_attention", record)
    page.click("#generate")
    for event, data in events:
        feed_stream(page, event, data)
    if finish:
        end_stream(page)
        page.wait_for_selector("#output[data-done]", state="attached")
