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


def attention(text: str, model: str | Path = "checkpoints/default", *, layers=None, heads=None,
              target: str | None = None, device: str = "cpu") -> Attention:
    """Every attention map of `text` by the checkpoint in directory `model` (or the `layers` /
    `heads` given): what POST /attention answers, computed here. An encoder frames the text as
    [CLS] text [SEP]; an encoder-decoder translates it greedily unless `target` is given."""
    import torch

    from attnlens.app.attention_codec import attention_maps
    from attnlens.app.encoder_tasks import encoder_attention_maps, framed_ids
    from attnlens.app.translation_attention import translation_maps

    path = Path(model).expanduser().resolve()
    ckpt = load(str(path), device)
    cfg, tok = ckpt.config, ckpt.tokenizer
    layers = _indices("layers", layers, cfg.n_layers)
    heads = _indices("heads", heads, cfg.n_heads)
    if target is not None and cfg.family != "encoder-decoder":
        raise ValueError(f"only an encoder-decoder takes a target; {path.name} is a {cfg.family}")
    ids = framed_ids(ckpt, text) if cfg.family == "encoder" else tok.encode(text)
    if not ids:
        raise ValueError("text encodes to no tokens")
    if len(ids) > cfg.context_length:
        raise ValueError(f"text has {len(ids)} tokens, more than the model's context length of {cfg.context_length}")
    tokens = [Token(i, tok.display_text(i)) for i in ids]
    common = dict(model=path.name, family=cfg.family, tokens=tokens, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                  layers=layers, heads=heads, format="float32", text=text)
    with torch.inference_mode():
        if cfg.family == "encoder-decoder":
            target_ids = None if target is None else tok.encode(target)
            if target_ids is not None and len(target_ids) + 1 > cfg.context_length:
                raise ValueError(f"target has {len(target_ids)} tokens; with the decoder's start token that is more "
                                 f"than the model's context length of {cfg.context_length}")
            maps = translation_maps(ckpt.model, ids, target_ids, layers, heads)
            return Attention.from_arrays(
                **common, direction="encoder-decoder", maps=maps.encoder, decoder=maps.decoder, cross=maps.cross,
                target_tokens=[Token(i, tok.display_text(i)) for i in maps.decoder_ids], generated=maps.generated)
        if cfg.family == "encoder":
            return Attention.from_arrays(**common, direction="bidirectional",
                                         maps=encoder_attention_maps(ckpt.model, ids, layers, heads))
        return Attention.from_arrays(**common, direction="causal", maps=attention_maps(ckpt.model, ids, layers, heads))
