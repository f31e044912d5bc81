"""attnlens.show for the causal answers (PatchAnswer, LogitAttributionAnswer): a self-contained HTML
document of heatmap tables, with no script, no server and no network.

The page has no Causes view to bundle yet (static/js/views/ holds none), so these documents are drawn
here in plain HTML and CSS: one table per grid, each cell coloured by its value (red raises the
metric, blue lowers it) with its exact figure in its tooltip.

    patch_document(answer)        heads [L x H]; by position [rows x T]; layers: attention and MLP;
                                  paths: q, k, v. Coloured by the normalised value (0 = the corrupted
                                  run, 1 = the clean run)
    attribution_document(answer)  heads [L x H] beside each layer's MLP, then the embedding, the rest
                                  and the logit difference they sum to

An encoder-decoder's answers (`target_tokens` given) draw a table per group: encoder heads over
source positions, decoder and cross heads over target positions; paths a table per receiver group and
input the sender reaches.
"""

from __future__ import annotations

import html
import math
from typing import Sequence

import numpy as np

from .answers import LogitAttributionAnswer, PatchAnswer, Token, _leaves

CSS = """
body { font: 12px/1.4 system-ui, sans-serif; margin: 12px; background: #fff; color: #222; }
body.dark { background: #16181c; color: #ddd; }
@media (prefers-color-scheme: dark) { body.auto { background: #16181c; color: #ddd; } }
h1 { font-size: 14px; margin: 0 0 6px; } h2 { font-size: 13px; margin: 14px 0 4px; }
.meta { margin: 2px 0; } .tok { font-family: ui-monospace, monospace; white-space: pre; padding: 0 1px; }
.tok.diff { background: #fde68a; color: #222; border-radius: 2px; }
table.grid { border-collapse: collapse; font-family: ui-monospace, monospace; font-size: 11px; }
table.grid th { font-weight: normal; padding: 1px 4px; text-align: right; white-space: pre; }
table.grid thead th { text-align: center; }
table.grid td { width: 38px; height: 16px; text-align: right; padding: 0 3px; border: 1px solid rgba(128,128,128,.15); }
td.none { background: repeating-linear-gradient(45deg, transparent 0 3px, rgba(128,128,128,.25) 3px 4px); }
.note { opacity: .7; margin-top: 8px; }
"""


def _colour(x: float) -> str:
    """x in [-1, 1]: red for positive, blue for negative, transparent at 0."""
    if math.isnan(x):
        return "transparent"
    a = min(1.0, abs(x))
    return f"rgba(220,38,38,{a:.3f})" if x > 0 else f"rgba(37,99,235,{a:.3f})"


def heatmap(grid: np.ndarray, rows: Sequence[str], cols: Sequence[str], *, scale: float,
            raw: np.ndarray | None = None, digits: int = 2) -> str:
    """An HTML table of `grid` (R, C): each cell coloured by grid / scale, showing its value; `raw`
    (same shape) the figures shown in the tooltips (default grid itself)."""
    raw = grid if raw is None else raw
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = []
    for r, label in enumerate(rows):
        cells = []
        for c, col in enumerate(cols):
            v, shown = float(grid[r, c]), float(raw[r, c])
            if math.isnan(v):
                cells.append(f'<td class="none" title="{html.escape(label)} {html.escape(col)}: none"></td>')
                continue
            tip = html.escape(f"{label} {col}: {shown:.4f}", quote=True)
            cells.append(f'<td style="background:{_colour(v / scale if scale else 0.0)}" title="{tip}">'
                         f"{v:.{digits}f}</td>")
        body.append(f"<tr><th>{html.escape(label)}</th>{''.join(cells)}</tr>")
    return f'<table class="grid"><thead><tr><th></th>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _tokens(tokens: list[Token], differing: Sequence[int] = ()) -> str:
    marked = set(differing)
    return "".join(f'<span class="tok{" diff" if i in marked else ""}" title="position {i}, id {t.id}">'
                   f"{html.escape(t.text)}</span>" for i, t in enumerate(tokens))


def _document(title: str, body: str, theme: str | None) -> str:
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head><body class=\"{theme or 'auto'}\">{body}</body></html>")


def _labels(tokens: list[Token], positions: Sequence[int]) -> list[str]:
    return [f"{p} {tokens[p].text.strip()[:8]}" for p in positions]


GROUP_NAMES = {"encoder": "encoder self-attention", "decoder": "decoder self-attention", "cross": "cross-attention"}
KINDS = {"q": "query", "k": "key", "v": "value"}


def _group_tables(answer: PatchAnswer) -> list[tuple[str, str]]:
    """An encoder-decoder's tables: a grid per group (layers: per sub-layer), encoder grids over every
    source position, the decoder's over the target up to the metric's position."""
    target = answer.target_tokens
    assert target is not None
    tables = []
    for path, raw in _leaves(answer.values):
        scaled = _leaves_at(answer.normalized, path)
        stack = path[0]
        tokens = answer.clean_tokens if stack == "encoder" else target
        shown = list(range(len(tokens) if stack == "encoder" else answer.position + 1))
        if answer.component == "layers":
            name = f"{'encoder' if stack == 'encoder' else 'decoder'} {path[1]} output"
        elif answer.component == "residual":
            name = f"{stack} residual stream (block input)"
        elif answer.component == "paths":
            if np.isnan(raw).all():  # the sender has no direct path into this input of this group
                continue
            name = f"{GROUP_NAMES[stack]} heads' {KINDS[path[1]]} input"
        else:
            name = f"{GROUP_NAMES[stack]} heads"
        L = raw.shape[0]
        if answer.component in ("heads", "paths"):
            H = raw.shape[1]
            table = heatmap(scaled, [f"L{l}" for l in range(L)], [f"H{h}" for h in range(H)], scale=1.0, raw=raw)
        elif answer.component == "heads_by_position":
            H = raw.shape[2]
            flat = lambda g: g[:, shown, :].transpose(0, 2, 1).reshape(L * H, len(shown))
            table = heatmap(flat(scaled), [f"L{l}H{h}" for l in range(L) for h in range(H)], _labels(tokens, shown),
                            scale=1.0, raw=flat(raw))
        else:
            table = heatmap(scaled[:, shown], [f"L{l}" for l in range(L)], _labels(tokens, shown), scale=1.0,
                            raw=raw[:, shown])
        tables.append((name, table))
    return tables


def _leaves_at(values, path: tuple[str, ...]):
    for name in path:
        values = values[name]
    return values


def patch_document(answer: PatchAnswer, theme: str | None = None) -> str:
    """The document of a /patch answer (module docstring)."""
    if answer.target_tokens is not None:
        return _patch_document(answer, _group_tables(answer), theme)
    norm = answer.normalized
    values = answer.values
    first = answer.differing[0] if answer.differing else answer.position
    shown = list(range(min(first, answer.position), answer.position + 1))  # earlier positions change nothing
    tables: list[tuple[str, str]] = []
    if answer.component in ("heads", "paths"):
        grids = {"": (values, norm)} if answer.component == "heads" else {k: (values[k], norm[k]) for k in values}
        for name, (raw, scaled) in grids.items():
            L, H = raw.shape
            tables.append((f"into the receivers' {name}" if name else "each head, every position",
                           heatmap(scaled, [f"L{l}" for l in range(L)], [f"H{h}" for h in range(H)], scale=1.0,
                                   raw=raw)))
    elif answer.component == "heads_by_position":
        L, _, H = values.shape
        raw = values[:, shown, :].transpose(0, 2, 1).reshape(L * H, len(shown))  # rows L{l}H{h}, columns positions
        scaled = norm[:, shown, :].transpose(0, 2, 1).reshape(L * H, len(shown))
        tables.append(("each head at one position", heatmap(scaled, [f"L{l}H{h}" for l in range(L) for h in range(H)],
                                                           _labels(answer.clean_tokens, shown), scale=1.0, raw=raw)))
    else:
        grids = {"residual stream (block input)": (values, norm)} if answer.component == "residual" else \
            {f"{k} output": (values[k], norm[k]) for k in values}
        for name, (raw, scaled) in grids.items():
            L = raw.shape[0]
            tables.append((name, heatmap(scaled[:, shown], [f"L{l}" for l in range(L)],
                                         _labels(answer.clean_tokens, shown), scale=1.0, raw=raw[:, shown])))
    return _patch_document(answer, tables, theme)


def _patch_document(answer: PatchAnswer, tables: list[tuple[str, str]], theme: str | None) -> str:
    sender = "" if not answer.sender else (f", sender L{answer.sender[0]}H{answer.sender[1]}" if len(answer.sender) == 2
                                           else f", sender {answer.sender[0]} L{answer.sender[1]}H{answer.sender[2]}")
    where = "target position" if answer.target_tokens is not None else "position"
    prompts = "source" if answer.target_tokens is not None else ""
    target = "" if answer.target_tokens is None else \
        f"<div class=\"meta\">target: {_tokens(answer.target_tokens, [answer.position])}</div>"
    title = f"{answer.model}: patching {answer.component} ({answer.method}{sender})"
    body = (f"<h1>{html.escape(title)}</h1>"
            f"<div class=\"meta\">metric: logit({html.escape(repr(answer.answer.text))}) - "
            f"logit({html.escape(repr(answer.foil.text))}) at {where} {answer.position}; clean "
            f"{answer.clean_metric:.3f}, corrupted {answer.corrupted_metric:.3f}</div>"
            f"<div class=\"meta\">clean {prompts}: {_tokens(answer.clean_tokens, answer.differing)}</div>"
            f"<div class=\"meta\">corrupted {prompts}: {_tokens(answer.corrupted_tokens, answer.differing)}</div>"
            + target + "".join(f"<h2>{html.escape(name)}</h2>{table}" for name, table in tables)
            + "<div class=\"note\">cells: the patched metric normalised, (v - corrupted) / (clean - corrupted): 1 "
              "restores the clean run, 0 changes nothing; red raises the metric, blue lowers it; the tooltip gives "
              "the raw metric</div>")
    return _document(title, body, theme)


def attribution_document(answer: LogitAttributionAnswer, theme: str | None = None) -> str:
    """The document of a /logit-attribution answer (module docstring)."""
    if isinstance(answer.heads, dict):  # an encoder-decoder's: decoder self and cross heads side by side
        L, H = answer.heads["decoder"].shape
        grid = np.concatenate([answer.heads["decoder"], answer.heads["cross"], answer.mlps[:, None]], axis=1)
        cols = [f"self H{h}" for h in range(H)] + [f"cross H{h}" for h in range(H)] + ["MLP"]
        heads = float(answer.heads["decoder"].sum() + answer.heads["cross"].sum())
    else:
        L, H = answer.heads.shape
        grid = np.concatenate([answer.heads, answer.mlps[:, None]], axis=1)  # (L, H + 1)
        cols, heads = [f"H{h}" for h in range(H)] + ["MLP"], float(answer.heads.sum())
    tokens = f"<div class=\"meta\">{_tokens(answer.tokens, [answer.position])}</div>"
    if answer.target_tokens is not None:  # the position is on the target
        tokens = (f"<div class=\"meta\">source: {_tokens(answer.tokens)}</div>"
                  f"<div class=\"meta\">target: {_tokens(answer.target_tokens, [answer.position])}</div>")
    scale = float(np.nanmax(np.abs(grid))) if grid.size else 1.0
    title = f"{answer.model}: direct logit attribution"
    rest = "".join(f"{html.escape(k)} {v:+.3f}; " for k, v in (answer.other_parts or {}).items())
    body = (f"<h1>{html.escape(title)}</h1>"
            f"<div class=\"meta\">logit({html.escape(repr(answer.answer.text))}) - "
            f"logit({html.escape(repr(answer.foil.text))}) at position {answer.position} = "
            f"{answer.logit_difference:.3f}</div>"
            + tokens + "<h2>each head's and MLP's direct write</h2>"
            + heatmap(grid, [f"L{l}" for l in range(L)], cols, scale=scale)
            + f"<div class=\"meta\">embedding {answer.embedding:+.3f}; other {answer.other:+.3f} ({rest.rstrip('; ')}); "
              f"heads {heads:+.3f}; MLPs {float(answer.mlps.sum()):+.3f}; sum {answer.total:.3f}</div>"
            + "<div class=\"note\">red writes toward the answer, blue toward the foil</div>")
    return _document(title, body, theme)
