"""/attention for an encoder-decoder: three groups of maps for a source and its target.

    encoder  the encoder's self-attention over the source      [layers][heads][S][S]
    decoder  the decoder's causal self-attention                [layers][heads][T][T]
    cross    decoder -> source (target down, source across)     [layers][heads][T][S]

The target rows are the decoder's inputs: its start token, then the target tokens (row t is
the step that wrote target token t + 1, or the end). Without a target the model's own
greedy translation is used, made in the same call on the model thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attnlens.model.families.encoder_decoder import attention_groups, greedy_translate_ids

from .attention_codec import encode


@dataclass
class TranslationMaps:
    target_ids: list[int]  # without the start token
    decoder_ids: list[int]  # the start token, then target_ids
    generated: bool  # True when target_ids is the model's own greedy translation
    encoder: np.ndarray  # (L', H', S, S)
    decoder: np.ndarray  # (L', H', T, T)
    cross: np.ndarray  # (L', H', T, S)


def translation_maps(model, source_ids: list[int], target_ids: list[int] | None, layers: list[int],
                     heads: list[int]) -> TranslationMaps:
    """Runs on the model thread: translate if needed, then one forward with every map."""
    cfg = model.config
    start = cfg.decoder_start_id
    generated = target_ids is None
    if generated:
        # the decoder's inputs (start + target) must fit the context: at most context - 1 target tokens
        target_ids = greedy_translate_ids(model, [source_ids], start, start,
                                          max_new_tokens=cfg.context_length - 1)[0]
    decoder_ids = [start, *target_ids]
    with torch.inference_mode():
        enc, dec, cross = attention_groups(model, source_ids, decoder_ids)
    pick = lambda a: a[layers][:, heads].float().cpu().numpy()  # (L, H, ., .) -> (L', H', ., .)
    return TranslationMaps(list(target_ids), decoder_ids, generated, pick(enc), pick(dec), pick(cross))


def group_fields(maps: np.ndarray, fmt: str, packing: str) -> dict:
    """One group's fields: shape and attention (json) or data/dtype/packing/scale."""
    return encode(maps, fmt, packing)


def translation_content(maps: TranslationMaps, tokenizer, fmt: str, packing: str) -> dict:
    """The encoder-decoder's fields of an /attention answer: the top-level maps are the
    encoder's (over the source); `translation` has the decoder's and the cross maps.
    `packing` "tril" applies to the decoder's causal maps only; the others are always full."""
    return {
        **group_fields(maps.encoder, fmt, "full"),
        "translation": {
            "target_tokens": [{"id": i, "text": tokenizer.display_text(i)} for i in maps.decoder_ids],
            "generated": maps.generated,
            "decoder": group_fields(maps.decoder, fmt, packing),
            "cross": group_fields(maps.cross, fmt, "full"),
        },
    }
