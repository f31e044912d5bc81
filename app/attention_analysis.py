"""/attention for any family: its declared attention groups, computed in one model call and laid
out by the declaration (model/families/contract.py).

    analyse_attention   on the model's side (the engine's line or a worker thread): the family's
                        `analyse`, then the asked layers and heads of every group, as numpy
    answer_fields       on a worker thread: the answer's fields, encoded as asked

The answer's layout: `groups` lists the family's attention groups as it declares them (name,
query axis, key axis, causal), the primary one first. The primary group's maps are at the top
level, over the tokens of its query axis (`tokens`); a family that reads a target (an
encoder-decoder) has its other groups under `translation` by name, with the target's tokens (the
decoder's start token first) and whether the target is the model's own greedy output. Packing
"tril" applies to causal groups; every other group is sent full.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attnlens.model import Family, family_of
from attnlens.model.hooks import Hooks, hooked

from .attention_codec import encode, encoded_bytes
from .engine import progress


@dataclass
class AnalysisMaps:
    tokens: dict[str, list[int]]  # axis -> ids
    maps: dict[str, np.ndarray]  # group -> (L', H', Q, K) float32
    generated_target: bool = False


def analyse_attention(model, ids: list[int], layers: list[int], heads: list[int],
                      target_ids: list[int] | None = None, ablate: tuple = ()) -> AnalysisMaps:
    """Runs on the model's side: every group's maps (with `ablate`, model/hooks.py's ZEdits, those of
    the ablated model; a default target is still the unablated model's output), then the asked
    layers and heads. A decoder computes the asked heads alone (its `analyse_heads`)."""
    if hasattr(model, "analyse_heads") and target_ids is None:  # a decoder: the asked heads alone
        maps = model.analyse_heads(ids, layers, heads, ablate, progress=progress.report)
        return AnalysisMaps({"tokens": list(ids)}, {family_of(model).primary.name: maps.cpu().numpy()})
    generated = False
    if ablate and target_ids is None and family_of(model).takes_target:
        tokens, generated = model.sequence(ids, None)  # the clean translation, before any edit
        target_ids = tokens["target"][1:]
    with hooked(model, Hooks(ablate=ablate, progress=progress.report)):
        analysis = model.analyse(ids, target_ids)
    analysis.generated_target = analysis.generated_target or generated
    pick = lambda a: a[layers][:, heads].float().cpu().numpy()  # (L, H, Q, K) -> (L', H', Q, K)
    return AnalysisMaps(analysis.tokens, {name: pick(m) for name, m in analysis.maps.items()},
                        analysis.generated_target)


def attention_maps(model, ids: list[int], layers: list[int], heads: list[int]) -> np.ndarray:
    """The primary group's (L', H', T, T) maps of one sequence (a decoder's or an encoder's)."""
    return analyse_attention(model, ids, layers, heads).maps[family_of(model).primary.name]


def packing_of(family: Family, group: str, packing: str) -> str:
    """"tril" only where the group is causal; everything else is sent full."""
    return packing if family.group(group).causal else "full"


def answer_bytes(family: Family, axis_lengths: dict[str, int], n_layers: int, n_heads: int, fmt: str,
                 packing: str) -> int:
    """An upper bound on the answer's bytes, every group counted (what an answer claims)."""
    total = 0
    for g in family.groups:
        Q, K = axis_lengths[g.queries], axis_lengths[g.keys]
        side = max(Q, K)  # encoded_bytes sizes square maps: a Q x K map fits in the larger square
        total += encoded_bytes([n_layers, n_heads, side, side], fmt, packing_of(family, g.name, packing))
    return total


def answer_fields(family: Family, analysis: AnalysisMaps, tokenizer, fmt: str, packing: str) -> dict:
    """The answer's attention fields for this family's groups (see the module docstring)."""
    token_list = lambda ids: [{"id": i, "text": tokenizer.display_text(i)} for i in ids]
    primary = family.primary
    fields = {"groups": [{"name": g.name, "queries": g.queries, "keys": g.keys, "causal": g.causal}
                         for g in family.groups],
              "tokens": token_list(analysis.tokens[primary.queries]),
              **encode(analysis.maps[primary.name], fmt, packing_of(family, primary.name, packing))}
    if family.takes_target:
        fields["translation"] = {
            "target_tokens": token_list(analysis.tokens["target"]),
            "generated": analysis.generated_target,
            **{g.name: encode(analysis.maps[g.name], fmt, packing_of(family, g.name, packing))
               for g in family.groups[1:]},
        }
    return fields
