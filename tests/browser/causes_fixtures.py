"""Answers of issue 46's causal routes, POST /patch and POST /logit-attribution, for the Causes
view's browser tests: the routes are built on another branch, so the page's requests are answered
here through Playwright's page.route, with bodies shaped as the API's contract says and values
shaped like a real patching run (a few heads carry most of the effect, one pushes the other way;
the residual stream carries the difference at the changed positions low down and at the last
position high up). The tokens are the real server's (POST /logits), so the page's prompts, the
answer and the foil it chose, and these answers agree.

    install(page, server)               # the model's own shape
    install(page, server, layers=30, heads=9)   # SmolLM2's 270 heads, whatever the model
"""

from __future__ import annotations

import json
import math

import httpx

CLEAN_METRIC = 2.75
CORRUPTED_METRIC = -1.25


def tokens(server, text: str) -> tuple[list[dict], list[dict]]:
    """The text's tokens and its top-10 next tokens, as the server gives them (POST /logits)."""
    r = httpx.post(f"{server.base_url}/logits", json={"text": text, "top_k": 10, "positions": "last"}, timeout=60)
    r.raise_for_status()
    a = r.json()
    return a["tokens"], a["positions"][-1]["top"]


def model_shape(server) -> tuple[int, int]:
    m = httpx.get(f"{server.base_url}/model", timeout=30).json()
    return m["architecture"]["n_layers"], m["architecture"]["n_heads"]


def _wiggle(*xs: int) -> float:
    """A small deterministic value in (-0.06, 0.06) for a cell."""
    return 0.06 * math.sin(1.7 + sum((i + 1) * 12.9898 * x for i, x in enumerate(xs)))


def head_pattern(L: int, H: int) -> list[list[float]]:
    """Normalised effects [L][H]: a strong late head, two middle ones, one that works against."""
    out = [[_wiggle(l, h) for h in range(H)] for l in range(L)]
    out[L - 1][1 % H] = 0.92
    out[L // 2][0] = 0.61
    out[max(0, L // 2 - 1)][H - 1] = 0.35
    out[max(0, L - 2)][2 % H] = -0.42
    return out


def position_pattern(L: int, T: int, differing: list[int], scale: float = 1.0) -> list[list[float]]:
    """Normalised effects [L][T]: the changed positions matter low down, the last position high up."""
    out = []
    for l in range(L):
        late = l / max(1, L - 1)
        row = [_wiggle(l, p) for p in range(T)]
        for p in differing:
            row[p] = scale * (1 - late)
        row[T - 1] = scale * late
        out.append(row)
    return out


def raw(x: float | None) -> float | None:
    """A normalised effect back to the metric it stands for."""
    return None if x is None else round(CORRUPTED_METRIC + x * (CLEAN_METRIC - CORRUPTED_METRIC), 6)


def _token(value, top: list[dict], fallback: dict) -> dict:
    for t in top:
        if value == t["id"] or value == t["text"]:
            return {"id": t["id"], "text": t["text"]}
    return {"id": fallback["id"] + 1, "text": value} if isinstance(value, str) else fallback


class CausalRoutes:
    """Answers the page's /patch and /logit-attribution requests; keeps their bodies."""

    def __init__(self, server, layers: int | None = None, heads: int | None = None):
        self.server = server
        self.L, self.H = (layers, heads) if layers else model_shape(server)
        self.patch_bodies: list[dict] = []
        self.attribution_bodies: list[dict] = []
        self.status = 200  # another status makes every answer an error with this code

    def patch(self, body: dict) -> dict:
        clean, top = tokens(self.server, body["clean"])
        corrupted, _ = tokens(self.server, body["corrupted"])
        L, H, T = self.L, self.H, len(clean)
        differing = [i for i, (a, b) in enumerate(zip(clean, corrupted)) if a["id"] != b["id"]]
        component, method = body.get("component", "heads"), body.get("method", "exact")
        k = 0.9 if method == "attribution" else 1.0  # first-order estimates: near the exact values
        if component == "heads":
            values = [[raw(k * x) for x in row] for row in head_pattern(L, H)]
        elif component == "heads_by_position":
            values = [[[raw(k * x * (p in differing or p == T - 1)) for x in hp] for p in range(T)] for hp in head_pattern(L, H)]
        elif component == "residual":
            values = [[raw(x) for x in row] for row in position_pattern(L, T, differing, k)]
        elif component == "layers":
            values = {"attention": [[raw(x) for x in row] for row in position_pattern(L, T, differing, 0.5 * k)],
                      "mlp": [[raw(x) for x in row] for row in position_pattern(L, T, differing, 0.8 * k)]}
        elif component == "paths":
            s = body["sender"]["layer"]
            values = {part: [[None if l <= s else raw(scale * x) for x in row] for l, row in enumerate(head_pattern(L, H))]
                      for part, scale in (("q", 0.8), ("k", 0.2), ("v", 0.5))}
        else:
            raise ValueError(component)
        answer = _token(body.get("answer_id", body.get("answer")), top, top[0])
        foil = _token(body.get("foil_id", body.get("foil")), top, top[1])
        out = {"model": "default", "component": component, "method": method, "position": T - 1,
               "clean_metric": CLEAN_METRIC, "corrupted_metric": CORRUPTED_METRIC, "values": values,
               "clean_tokens": clean, "corrupted_tokens": corrupted, "differing": differing,
               "answer": answer, "foil": foil}
        if component == "paths":
            out["sender"] = body["sender"]
        return out

    def attribution(self, body: dict) -> dict:
        toks, top = tokens(self.server, body["text"])
        L, H = self.L, self.H
        heads = [[round(3.0 * x, 6) for x in row] for row in head_pattern(L, H)]
        mlps = [round(0.4 * math.cos(l) + (1.1 if l == L - 1 else 0), 6) for l in range(L)]
        embedding, other = 0.3, -0.05
        total = embedding + other + sum(map(sum, heads)) + sum(mlps)
        return {"model": "default", "tokens": toks, "position": len(toks) - 1,
                "answer": _token(body.get("answer_id", body.get("answer", top[0]["id"])), top, top[0]),
                "foil": _token(body.get("foil_id", body.get("foil", top[1]["id"])), top, top[1]),
                "logit_difference": round(total, 6), "heads": heads, "mlps": mlps, "embedding": embedding, "other": other}

    def handle(self, route, request) -> None:
        body = json.loads(request.post_data or "{}")
        if self.status != 200:
            route.fulfill(status=self.status, content_type="application/json",
                          body=json.dumps({"detail": "corrupted has 9 tokens and clean 8: the corrupted prompt must have as many tokens as the clean one"}))
            return
        if request.url.endswith("/patch"):
            self.patch_bodies.append(body)
            answer = self.patch(body)
        else:
            self.attribution_bodies.append(body)
            answer = self.attribution(body)
        route.fulfill(status=200, content_type="application/json", body=json.dumps(answer))


def install(page, server, layers: int | None = None, heads: int | None = None) -> CausalRoutes:
    """From now on the page's /patch and /logit-attribution get these answers."""
    routes = CausalRoutes(server, layers, heads)
    page.route("**/patch", routes.handle)
    page.route("**/logit-attribution", routes.handle)
    return routes
