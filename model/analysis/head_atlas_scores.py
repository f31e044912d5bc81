"""/heads' scores on the model's side: the family's `analyse`, then every attention group's (L, H)
scores (model/analysis/head_scores.py's definitions), as numpy; only the scores travel back, never
the maps.

    group_kind    "cross" | "causal" | "bidirectional": which definitions score a group
    ClarkProbe    an encoder's real-text probe, as the model side needs it (the service frames it)
    clark_groups  the groups Clark et al.'s scores are given for
    clark_scores  Clark et al.'s scores of each sentence, their mean
    score_heads   every group's scores of one sequence (and Clark et al.'s with a probe)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attnlens.model.analysis import head_scores as hs
from attnlens.model.families.contract import Family, family_of


@dataclass
class ClarkProbe:
    """The sentences Clark et al.'s scores average over, as the model side needs them: each
    framed sentence's ids and which of its tokens are punctuation (from the tokenizer's token
    strings, so worked out on the service's side)."""

    sentences: list[str]
    ids: list[list[int]]  # [CLS] sentence [SEP], each
    punctuation: list[list[bool]]  # per sentence, per token
    cls_id: int
    sep_id: int


@dataclass
class HeadScoreResult:
    tokens: dict[str, list[int]]  # axis -> ids
    scores: dict[str, dict[str, np.ndarray]]  # group -> score -> (L, H) float64 (NaN: undefined)
    generated_target: bool = False


def group_kind(group) -> str:
    """"cross" | "causal" | "bidirectional": which definitions score a group."""
    return "cross" if group.is_cross else "causal" if group.causal else "bidirectional"


def clark_groups(family: Family) -> list[str]:
    """The groups Clark et al.'s scores are given for: a [CLS] text [SEP] family's bidirectional
    self groups over its tokens (an encoder's "self")."""
    if family.framing != "cls_sep":
        return []
    return [g.name for g in family.groups if group_kind(g) == "bidirectional" and g.queries == g.keys == "tokens"]


@torch.inference_mode()
def clark_scores(model, probe: ClarkProbe) -> dict[str, dict[str, torch.Tensor]]:
    """Each sentence's maps, Clark et al.'s scores of each, their mean: group -> score -> (L, H)."""
    groups = clark_groups(family_of(model))
    per_text: dict[str, list] = {g: [] for g in groups}
    for ids, punctuation in zip(probe.ids, probe.punctuation):
        maps = model.analyse(ids).maps
        tokens = torch.tensor(ids, dtype=torch.long)
        marks = torch.tensor(punctuation, dtype=torch.bool)
        for g in groups:
            per_text[g].append(hs.clark_text_scores(maps[g], tokens, probe.cls_id, probe.sep_id, marks))
        del maps
    return {g: hs.mean_over_texts(found) for g, found in per_text.items() if found}


@torch.inference_mode()
def score_heads(model, ids: list[int], target_ids: list[int] | None = None,
                clark: ClarkProbe | None = None) -> HeadScoreResult:
    """The family's maps, then every group's (L, H) scores; with `clark`, an encoder's groups also
    get Clark et al.'s scores on its sentences."""
    family = family_of(model)
    analysis = model.analyse(ids, target_ids)
    scores = {}
    for g in family.groups:
        maps = analysis.maps[g.name]
        if g.is_cross:
            found = hs.cross_group_scores(maps)
        else:
            tokens = torch.tensor(analysis.tokens[g.queries], dtype=torch.long)
            found = hs.self_group_scores(maps, tokens, g.causal)
        scores[g.name] = {name: s.double().cpu().numpy() for name, s in found.items()}
    tokens, generated = analysis.tokens, analysis.generated_target
    del analysis, maps  # the input's maps go before the sentences' come
    if clark is not None:
        for group, found in clark_scores(model, clark).items():
            scores[group].update({name: s.double().cpu().numpy() for name, s in found.items()})
    return HeadScoreResult(tokens, scores, generated)
