"""Attention of a text by a checkpoint on disk, computed in this process: no server.

    answer = attnlens.local.attention("To be, or not to be", "checkpoints/default")
    attnlens.show(text="To be, or not to be", model="checkpoints/default")      # the same, drawn

The answer is the one /attention gives for the same checkpoint and text (the same functions
compute it: the family's analyse() through attnlens.model.analysis.attention_maps, and the encoder's
framing), laid out by the model's family declaration, as an attnlens.Attention with exact
float32 maps. Needs attnlens[model] (torch, tokenizers,
safetensors); checkpoints are loaded once per process (on the CPU unless told otherwise).
"""

from __future__ import annotations

import functools
from pathlib import Path

from .answers import Attention, Token


@functools.lru_cache(maxsize=4)
def load(path: str, device: str = "cpu"):
    """The checkpoint at `path` (a directory), loaded once per process and device."""
    from attnlens.model import load_checkpoint

    return load_checkpoint(path, device=device)


def _indices(name: str, requested, n: int) -> list[int]:
    if requested is None:
        return list(range(n))
    out = [int(i) for i in requested]
    bad = [i for i in out if not 0 <= i < n]
    if bad:
        raise ValueError(f"{name}: index {bad[0]} out of range: the model has {n} {name} (0..{n - 1})")
    if len(set(out)) != len(out):
        raise ValueError(f"{name}: indices must not repeat")
    return out


def attention(text: str, model: str | Path = "checkpoints/default", *, layers=None, heads=None,
              target: str | None = None, device: str = "cpu", pool: int | None = None, top_k: int | None = None,
              rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> Attention:
    """Every attention map of `text` by the checkpoint in directory `model` (or the `layers` /
    `heads` given): what POST /attention answers, computed here. An encoder frames the text as
    [CLS] text [SEP]; an encoder-decoder translates it greedily unless `target` is given.
    `pool`, `top_k`, `rows`, `cols` reduce each map as /attention's do (a long text's overview,
    strongest links, or a window)."""
    import torch

    from attnlens.app.serving.encoder_tasks import framed_ids
    from attnlens.model import family_of
    from attnlens.model.analysis.attention_maps import MapRequest, analyse_attention

    from .answers import GroupSpec

    path = Path(model).expanduser().resolve()
    ckpt = load(str(path), device)
    cfg, tok, family = ckpt.config, ckpt.tokenizer, family_of(ckpt.model)
    layers = _indices("layers", layers, cfg.n_layers)
    heads = _indices("heads", heads, cfg.n_heads)
    if target is not None and not family.takes_target:
        raise ValueError(f"only an encoder-decoder takes a target; {path.name} is a {family.name}")
    ids = framed_ids(ckpt, text) if family.framing == "cls_sep" else tok.encode(text)
    if not ids:
        raise ValueError("text encodes to no tokens")
    if len(ids) > cfg.context_length:
        raise ValueError(f"text has {len(ids)} tokens, more than the model's context length of {cfg.context_length}")
    target_ids = None if target is None else tok.encode(target)
    if target_ids is not None and len(target_ids) + 1 > cfg.context_length:
        raise ValueError(f"target has {len(target_ids)} tokens; with the decoder's start token that is more than "
                         f"the model's context length of {cfg.context_length}")
    if pool is not None and top_k is not None:
        raise ValueError("give pool or top_k, not both")
    for name, window in (("rows", rows), ("cols", cols)):
        if window is not None and not 0 <= window[0] < min(window[1], len(ids) + 1):
            raise ValueError(f"{name}: a window [start, end) of the text's {len(ids)} positions, got {window}")
    want = MapRequest(pool=pool, top_k=top_k, rows=None if rows is None else (rows[0], rows[1]),
                      cols=None if cols is None else (cols[0], cols[1]))
    with torch.inference_mode():
        analysis = analyse_attention(ckpt.model, ids, layers, heads, target_ids, want=want)
    maps, axes = analysis.maps, analysis.tokens
    reduced = {name: {"query_range": tuple(e["rows"]), "key_range": tuple(e["cols"]),
                      "row_edges": e.get("row_edges"), "col_edges": e.get("col_edges"),
                      "positions": e.get("positions")} for name, e in analysis.extras.items()}

    def as_tokens(ids: list[int]) -> list[Token]:
        return [Token(i, tok.display_text(i)) for i in ids]

    specs = [GroupSpec(g.name, g.queries, g.keys, g.causal) for g in family.groups]
    return Attention.from_arrays(
        model=path.name, family=family.name, direction=family.attention_kind, n_layers=cfg.n_layers,
        n_heads=cfg.n_heads, layers=layers, heads=heads, format="float32", text=text, specs=specs, maps=maps,
        tokens=as_tokens(axes[family.primary.queries]),
        target_tokens=as_tokens(axes["target"]) if family.takes_target else None,
        generated=analysis.generated_target if family.takes_target else None, reduced=reduced)
