"""attnlens.show: the page's views inline in a notebook, with no server and no network.

    attnlens.show(answer)                                    # an Attention from attnlens.Client
    attnlens.show(answer, view="model")                      # every layer x head
    attnlens.show(answer, view="lines", layer=2, head=5)
    attnlens.show(client.fill_mask("The [MASK] of Denmark", model="encoder"))
    attnlens.show(text="To be, or not to be", model="checkpoints/default")   # in this process
    attnlens.show(client.patch(clean, corrupted, answer=" Mary", foil=" John"))   # heatmap tables

The object it returns displays itself in Jupyter (`_repr_html_`): an iframe whose document holds
the page's own view modules (static/js, bundled by attnlens/bundle.py), its CSS and the answer.
So it draws with no server running and no network, it survives export to HTML (nbconvert), and
two views never collide (each is a document of its own). `.save(path)` writes the same
document as a standalone .html file.
"""

from __future__ import annotations

import functools
import html
import re
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from .answers import Attention, Classification, FillMask, Generation, LogitAttributionAnswer, PatchAnswer
from .codec import encode
from .resources import checkpoints_dir, static_dir

# State keys of the page (state/schema.js) that say what is shown rather than what is analysed
# (ablate, explain and probe ask the server's analysis routes: the live page's, not a notebook's)
NOT_OPTIONS = {"model", "prompt", "source", "ids", "plen", "view", "diff", "promptB", "fillk", "ablate", "explain", "probe"}


@functools.lru_cache(maxsize=8)
def _read_once(path: str, mtime_ns: int) -> str:
    return Path(path).read_text(encoding="utf-8")


def _read(path: Path) -> str:
    """A page file's text, read again only when it changes."""
    return _read_once(str(path), path.stat().st_mtime_ns)


def _field(entry: str, name: str) -> str | None:
    m = re.search(rf'\b{name}:\s*"([^"]*)"', entry)
    return m.group(1) if m else None


def page_views(root: Path | None = None) -> dict[str, dict]:
    """The page's views from its registry (static/js/views/registry.js): id -> {label, source,
    needs (the capabilities a model must have: static/js/family.js)}. The one list of views;
    inline.js draws the "analysis" ones."""
    text = _read((root or static_dir()) / "js" / "views" / "registry.js")
    start = text.index("export const VIEWS")
    block = text[start:text.index("];", start)]
    entries = re.split(r"(?=\bid:\s*\")", block)[1:]  # one piece per view, however it is laid out
    views: dict[str, dict] = {}
    for entry in entries:
        needs = re.search(r"\bneeds:\s*\[([^\]]*)\]", entry)
        name = _field(entry, "id")
        assert name is not None  # each piece starts at its id (the split above)
        views[name] = {
            "label": _field(entry, "label") or name,
            "source": _field(entry, "source") or "analysis",
            "needs": re.findall(r'"([\w-]+)"', needs.group(1)) if needs else [],
        }
    return views


def family_info(answer: Attention | Generation) -> dict:
    """The family declaration the embedded document reads (as GET /models' family_info): an
    Attention's from the groups it holds; a Generation's from whether its steps read a source."""
    if isinstance(answer, Attention):
        groups = [{"name": g.name, "queries": g.queries, "keys": g.keys, "causal": g.causal,
                   "cross": g.queries != g.keys, "description": ""} for g in answer.groups.values()]
        axes = sorted({a for g in answer.groups.values() for a in (g.queries, g.keys)})
        return {"groups": groups, "axes": axes, "generation": None}
    if answer.tokens and answer.tokens[0].cross_attention is not None:  # its steps read the prompt as a source
        return {"groups": [{"name": "decoder", "queries": "target", "keys": "target", "causal": True, "cross": False},
                           {"name": "cross", "queries": "target", "keys": "source", "causal": False, "cross": True}],
                "axes": ["source", "target"], "generation": {"prompt": "source", "step_groups": ["decoder", "cross"]}}
    return {"groups": [{"name": "self", "queries": "tokens", "keys": "tokens", "causal": True, "cross": False}],
            "axes": ["tokens"], "generation": {"prompt": "prefix", "step_groups": ["self"]}}


def capabilities(info: dict) -> set[str]:
    """What static/js/family.js reads from a declaration (the views' `needs`), in Python."""
    caps, cross = set(), {g["name"] for g in info["groups"] if g["cross"]}
    if info["generation"]:
        caps.add("generation")
        if info["generation"]["prompt"] == "source":
            caps.add("prompt-source")
        if info["generation"]["prompt"] == "prefix":
            caps.add("prompt-prefix")
        if cross & set(info["generation"]["step_groups"]):
            caps.add("step-cross")
    if "target" in info["axes"]:
        caps.add("target")
    if cross:
        caps.add("cross")
    return caps


def inline_views(answer: Attention | Generation, root: Path | None = None) -> list[str]:
    """The views that show this answer inline (as inline.js's inlineViews): the analysis views for
    an Attention, the generation views for a Generation, each where its `needs` are met."""
    source = "generation" if isinstance(answer, Generation) else "analysis"
    caps = capabilities(family_info(answer))
    return [v for v, d in page_views(root).items() if d["source"] == source and set(d["needs"]) <= caps]


def view_options(root: Path | None = None) -> set[str]:
    """The page's display settings a view takes as keyword arguments (state/schema.js's URL keys:
    cmap, scale, sink, pin, zoom, op, layers, heads, xavg, layerB, headB, ...)."""
    text = _read((root or static_dir()) / "js" / "state" / "schema.js")
    keys = re.findall(r'\{\s*key:\s*"(\w+)"[^}]*\burl:\s*true', text)
    return set(keys) - NOT_OPTIONS


def _pooled_overview(answer: Attention) -> dict:
    """A pooled answer's primary group as the page's overview: every layer and head (NaN where the
    answer holds none), in f16, with its bins."""
    g = answer.groups[next(iter(answer.groups))]
    assert g.query_range is not None and g.key_range is not None  # a pooled answer's window
    full = np.full((answer.n_layers, answer.n_heads, *g.maps.shape[2:]), np.nan, dtype=np.float32)
    full[np.ix_(answer.layers, answer.heads)] = g.maps
    return {**encode(full, "f16", "full"), "row_edges": g.row_edges, "col_edges": g.col_edges,
            "rows": list(g.query_range), "cols": list(g.key_range),
            "layers": list(range(answer.n_layers)), "heads": list(range(answer.n_heads))}


def _reduction(answer: Attention) -> str:
    """What the answer's maps are: "map" (whole), "pool" (an overview), "top_k" or "window"."""
    def kind(g) -> str:
        if g.kind != "map":
            return g.kind
        whole = g.query_range in (None, (0, len(g.rows))) and g.key_range in (None, (0, len(g.cols)))
        return "map" if whole else "window"

    kinds = {kind(g) for g in answer.groups.values()}
    return next((k for k in ("top_k", "window", "pool") if k in kinds), "map")


def _wire(answer: Attention) -> dict:
    """The answer as /attention sends it, in f16 (causal maps lower-triangle only): what the
    embedded document decodes with the page's own decoder. Its groups as declared: the primary
    at the top level, the others (over a target) under `translation`. A pooled answer: its
    primary group's overview alone (the model view draws it)."""
    def group(g) -> dict:
        return encode(g.maps, "f16", "tril" if g.causal else "full")

    if _reduction(answer) == "pool":
        primary = next(iter(answer.groups.values()))
        return {"model": answer.model, "family": answer.family, "direction": answer.direction,
                "groups": [{"name": primary.name, "queries": primary.queries, "keys": primary.keys,
                            "causal": primary.causal}],
                "tokens": [{"id": t.id, "text": t.text} for t in answer.tokens], "n_layers": answer.n_layers,
                "n_heads": answer.n_heads, "format": "f16", **_pooled_overview(answer)}

    as_list = lambda tokens: [{"id": t.id, "text": t.text} for t in tokens]
    primary, *others = answer.groups.values()
    out = {"model": answer.model, "family": answer.family, "direction": answer.direction,
           "groups": [{"name": g.name, "queries": g.queries, "keys": g.keys, "causal": g.causal}
                      for g in answer.groups.values()],
           "tokens": as_list(answer.tokens), "n_layers": answer.n_layers, "n_heads": answer.n_heads,
           "layers": answer.layers, "heads": answer.heads, "format": "f16", **group(primary)}
    if others:
        out["translation"] = {"target_tokens": as_list(answer.target_tokens), "generated": bool(answer.generated),
                              **{g.name: group(g) for g in others}}
    return out


class InlineView:
    """A view Jupyter displays inline (an iframe holding a self-contained document).
    `html()` is that document; `save(path)` writes it to a file."""

    def __init__(self, spec: dict, title: str, height: int = 560):
        self.spec = spec
        self.title = title
        self.height = height

    def html(self) -> str:
        """The standalone document: the page's modules, its CSS and the data, nothing outside it."""
        from .bundle import document

        return document(self.spec, title=self.title)

    def _repr_html_(self) -> str:
        frame_id = f"attnlens-{uuid.uuid4().hex[:12]}"  # every display its own
        return (f'<iframe id="{frame_id}" class="attnlens-view" title="{html.escape(self.title)}" '
                f'style="width: 100%; height: {self.height}px; border: 0;" '
                f'srcdoc="{html.escape(self.html(), quote=True)}"></iframe>')

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.html(), encoding="utf-8")
        return path

    def __repr__(self) -> str:
        return f"<attnlens view: {self.title}>"


class DocumentView(InlineView):
    """An InlineView of a document made here rather than by the page's views (attnlens/causes_html.py:
    the causal answers, which the page draws no view of yet)."""

    def __init__(self, document: str, title: str, height: int = 560):
        super().__init__({}, title, height)
        self.document = document

    def html(self) -> str:
        return self.document


def _causes(answer: PatchAnswer | LogitAttributionAnswer, view: str | None, theme: str | None,
            height: int | None, options: dict) -> DocumentView:
    """A /patch or /logit-attribution answer's heatmap tables (attnlens/causes_html.py)."""
    from .causes_html import attribution_document, patch_document

    if view not in (None, "causes"):
        raise ValueError(f"a {type(answer).__name__} has one view, 'causes', not {view!r}")
    if options:
        raise TypeError(f"a {type(answer).__name__}'s view takes no options (got {sorted(options)})")
    if isinstance(answer, PatchAnswer):
        document, title = patch_document(answer, theme), f"{answer.model}: patching {answer.component}"
    else:
        document, title = attribution_document(answer, theme), f"{answer.model}: direct logit attribution"
    return DocumentView(document, title, height or min(900, 200 + 19 * document.count("<tr>")))


def _held(rows: np.ndarray | None) -> np.ndarray:
    """A step's attention rows: every token holds them (_generation checks it first)."""
    assert rows is not None, "a token without attention"
    return rows


def _generation(gen: Generation) -> tuple[dict, dict]:
    """The model's shape and a generation's tokens with each step's attention row ([layer][head][key];
    an encoder-decoder's cross-attention row over the source), as the page's GenerationRecord holds them."""
    if not gen.tokens or any(t.attention is None for t in gen.tokens):
        raise ValueError("this generation holds no attention: generate with return_attention=True")
    cross = gen.tokens[0].cross_attention is not None
    rows = [np.round(_held(t.cross_attention if cross else t.attention), 5).tolist() for t in gen.tokens]
    L, H = _held(gen.tokens[0].attention).shape[:2]
    tokens = [{"id": t.id, "text": t.text, "logprob": t.logprob, "delta": t.delta if t.delta is not None else t.text,
               "top_logprobs": [a.__dict__ for a in t.top_logprobs]} for t in gen.tokens]
    model = {"name": gen.model, "family": gen.model, "family_info": family_info(gen), "n_layers": int(L),
             "n_heads": int(H)}
    data = {"prompt_tokens": [{"id": t.id, "text": t.text} for t in gen.prompt_tokens], "tokens": tokens, "rows": rows}
    return model, data


def _check_index(name: str, value: int | None, held: list[int]) -> int | None:
    if value is not None and value not in held:
        raise ValueError(f"{name} {value} is not in this answer: it holds {name}s {held}")
    return value


def show(answer: Attention | Generation | FillMask | Classification | PatchAnswer | LogitAttributionAnswer | None = None,
         view: str | None = None, *,
         layer: int | None = None, head: int | None = None, text: str | None = None,
         model: str | Path | None = None, theme: str | None = None, height: int | None = None,
         **options: Any) -> InlineView:
    """A view of `answer` that Jupyter draws inline, with no server and no network.

    answer: an Attention (attnlens.Client.attention), a Generation made with
    return_attention=True (its "gen" view: what each step attended to), a FillMask or a
    Classification; a PatchAnswer or LogitAttributionAnswer (client.patch, client.logit_attribution)
    as heatmap tables of its own (attnlens/causes_html.py: the page has no Causes view yet). Or
    give `text` (and `model`, a checkpoint directory, default checkpoints/default) instead: the attention is then computed in this process
    (attnlens.local; needs attnlens[model]).
    view: one of the page's views for this family ("head", "model", "aggregate", "diff",
    "lines"; a translator's also "cross", "align", "decoder"; default "head", a translator's
    "cross"). layer / head: model indices the answer holds. options: the page's display
    settings (cmap, scale, sink, pin, zoom, op, layers, heads, xavg, layerB, headB, step).
    theme: "light" or "dark" (default: the system's)."""
    if answer is None:
        if text is None:
            raise TypeError("show() needs an answer, or text= (and model=) to compute one here")
        from .local import attention

        answer = attention(text, model if model is not None else checkpoints_dir() / "default")
    elif text is not None or model is not None:
        raise TypeError("give either an answer or text= / model=, not both")
    if theme not in (None, "light", "dark"):
        raise ValueError(f"theme must be 'light' or 'dark', not {theme!r}")
    if isinstance(answer, (PatchAnswer, LogitAttributionAnswer)):
        if layer is not None or head is not None:
            raise TypeError(f"a {type(answer).__name__}'s view shows every layer and head: give no layer or head")
        return _causes(answer, view, theme, height, options)
    if isinstance(answer, FillMask):
        spec: dict[str, Any] = {"kind": "fill-mask", "model": answer.model, "text": answer.text,
                "masks": [[c.__dict__ for c in row] for row in answer.masks], "theme": theme}
        return InlineView(spec, f"{answer.model}: fill-mask", height or 120 + 150 * len(answer.masks))
    if isinstance(answer, Classification):
        spec = {"kind": "classify", "model": answer.model, "text": answer.text,
                "labels": [l.__dict__ for l in answer.labels], "theme": theme}
        return InlineView(spec, f"{answer.model}: classify", height or 120 + 26 * len(answer.labels))
    if isinstance(answer, Generation):
        shape, generation = _generation(answer)
        kind = "generation"
        layers, heads = list(range(shape["n_layers"])), list(range(shape["n_heads"]))
        payload: dict[str, Any] = {"generation": generation, "text": answer.text}
    elif isinstance(answer, Attention):
        reduction = _reduction(answer)
        if reduction not in ("map", "pool"):
            raise ValueError(f"show() draws whole maps, or a pooled overview (pool=N) in the model view; this answer "
                             f"holds a {'top-k' if reduction == 'top_k' else 'window'} (read its arrays: "
                             f"answer.groups[name].maps, .positions, .query_range, .key_range)")
        if reduction == "pool" and view not in (None, "model"):
            raise ValueError(f"a pooled answer (pool=N) is drawn in the model view, not {view!r}")
        view = "model" if reduction == "pool" else view
        shape = {"name": answer.model, "family": answer.family, "family_info": family_info(answer),
                 "attention": answer.direction, "n_layers": answer.n_layers, "n_heads": answer.n_heads}
        kind = "attention"
        layers, heads = answer.layers, answer.heads
        payload = {"answer": _wire(answer), "text": answer.text or ""}
    else:
        raise TypeError(f"show() draws an Attention, Generation, FillMask, Classification, PatchAnswer or "
                        f"LogitAttributionAnswer, not "
                        f"{type(answer).__name__}")
    views = inline_views(answer)
    # the first view: a generation's steps; an answer with a cross group, its cross-attention
    view = view or ("gen" if kind == "generation" else "cross" if "cross" in views else "head")
    if view not in views:
        what = "attention answer" if kind == "attention" else kind
        raise ValueError(f"view {view!r} is not one this {what} has here; choose from {views}")
    unknown = set(options) - view_options()
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; the views take {sorted(view_options())}")
    state = {k: v for k, v in {"layer": _check_index("layer", layer, layers),
                               "head": _check_index("head", head, heads), **options}.items() if v is not None}
    spec = {"kind": kind, "model": shape, "view": view, "state": state,
            "theme": theme, **payload}
    title = f"{answer.model}: {view} view" + (f", layer {layer} head {head}" if layer is not None and head is not None else "")
    return InlineView(spec, title, height or 560)
