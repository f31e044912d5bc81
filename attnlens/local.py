"""Attention of a text by a checkpoint on disk, computed in this process: no server.

    answer = attnlens.local.attention("To be, or not to be", "checkpoints/default")
    attnlens.show(text="To be, or not to be", model="checkpoints/default")      # the same, drawn

The answer is the one /attention gives for the same checkpoint and text (the same functions
compute it: attnlens.app.attention_codec, encoder_tasks, translation_attention), as an
attnlens.Attention with exact float32 maps. Needs attnlens[model] (torch, tokenizers,
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


def _analyse(ckpt, ids: list[int], layers: list[int], heads: list[int], target_ids: list[int] | None):
    """The family's groups of maps for `ids` (and a target): {group: (L', H', Q, K)}, the tokens
    along each axis, whether the target is the model's own, by the server's own functions."""
    try:  # the family contract (model/families/contract.py): every family analysed by one call
        from attnlens.app.attention_analysis import analyse_attention
    except ImportError:  # before the contract: a function per family
        return _analyse_per_family(ckpt, ids, layers, heads, target_ids)
    analysis = analyse_attention(ckpt.model, ids, layers, heads, target_ids)
    return analysis.maps, analysis.tokens, analysis.generated_target


def _analyse_per_family(ckpt, ids, layers, heads, target_ids):
    family = ckpt.config.family
    if family == "encoder-decoder":
        from attnlens.app.translation_attention import translation_maps

        m = translation_maps(ckpt.model, ids, target_ids, layers, heads)
        return ({"encoder": m.encoder, "decoder": m.decoder, "cross": m.cross},
                {"source": ids, "target": m.decoder_ids}, m.generated)
    if family == "encoder":
        from attnlens.app.encoder_tasks import encoder_attention_maps

        return {"self": encoder_attention_maps(ckpt.model, ids, layers, heads)}, {"tokens": ids}, False
    from attnlens.app.attention_codec import attention_maps

    return {"self": attention_maps(ckpt.model, ids, layers, heads)}, {"tokens": ids}, False


def attention(text: str, model: str | Path = "checkpoints/default", *, layers=None, heads=None,
              target: str | None = None, device: str = "cpu") -> Attention:
    """Every attention map of `text` by the checkpoint in directory `model` (or the `layers` /
    `heads` given): what POST /attention answers, computed here. An encoder frames the text as
    [CLS] text [SEP]; an encoder-decoder translates it greedily unless `target` is given."""
    import torch

    from attnlens.app.encoder_tasks import framed_ids

    path = Path(model).expanduser().resolve()
    ckpt = load(str(path), device)
    cfg, tok = ckpt.config, ckpt.tokenizer
    layers = _indices("layers", layers, cfg.n_layers)
    heads = _indices("heads", heads, cfg.n_heads)
    translator = cfg.family == "encoder-decoder"
    if target is not None and not translator:
        raise ValueError(f"only an encoder-decoder takes a target; {path.name} is a {cfg.family}")
    ids = framed_ids(ckpt, text) if cfg.family == "encoder" else tok.encode(text)
    if not ids:
        raise ValueError("text encodes to no tokens")
    if len(ids) > cfg.context_length:
        raise ValueError(f"text has {len(ids)} tokens, more than the model's context length of {cfg.context_length}")
    target_ids = None if target is None else tok.encode(target)
    if target_ids is not None and len(target_ids) + 1 > cfg.context_length:
        raise ValueError(f"target has {len(target_ids)} tokens; with the decoder's start token that is more than "
                         f"the model's context length of {cfg.context_length}")
    with torch.inference_mode():
        maps, axes, generated = _analyse(ckpt, ids, layers, heads, target_ids)

    def as_tokens(ids: list[int]) -> list[Token]:
        return [Token(i, tok.display_text(i)) for i in ids]

    direction = {"decoder": "causal", "encoder": "bidirectional"}.get(cfg.family, cfg.family)
    common = dict(model=path.name, family=cfg.family, direction=direction, n_layers=cfg.n_layers,
                  n_heads=cfg.n_heads, layers=layers, heads=heads, format="float32", text=text)
    if translator:
        return Attention.from_arrays(**common, tokens=as_tokens(axes["source"]), maps=maps["encoder"],
                                     decoder=maps["decoder"], cross=maps["cross"],
                                     target_tokens=as_tokens(axes["target"]), generated=generated)
    return Attention.from_arrays(**common, tokens=as_tokens(axes["tokens"]), maps=maps["self"])
