"""The head atlas (POST /heads): every head of every attention group scored from the maps the
family's `analyse` computes, with a role per head.

    probe_ids         the repeated-random probe, framed as the family frames a text
    score_heads       on the model's side (the engine's model-call line or a worker thread): the
                      family's `analyse`, then each group's scores (model/head_scores.py), as numpy;
                      only the (L, H) scores travel back, never the maps
    atlas_answer      on a worker thread: the answer's fields (tokens, groups, roles, definitions)

A group is scored by what the family declares about it (model/families/contract.py): a cross
group (queries on another axis than keys) gets the cross scores; a causal self group
TransformerLens's detection scores; any other self group their bidirectional analogues.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from attnlens.model import Family, family_of
from attnlens.model import head_scores as hs

DEFAULT_PROBE_LENGTH = 50
AXIS_FIELD = {"tokens": "tokens", "source": "tokens", "target": "target_tokens"}  # axis -> the answer's field


# --- the probe --------------------------------------------------------------------------------


def probe_overhead(family: Family) -> int:
    """Tokens the probe has besides its 2n random ones: BOS, or [CLS] and [SEP]."""
    return 2 if family.framing == "cls_sep" else 1


def max_probe_length(family: Family, context_length: int) -> int:
    """The largest n whose probe fits the context (0: none fits)."""
    return (context_length - probe_overhead(family)) // 2


def probe_ids(family: Family, tokenizer, length: int, seed: int) -> list[int]:
    """BOS + n random ordinary tokens + the same n (model/head_scores.repeated_random_tokens, the
    evaluation report's draw); a family that frames a text as [CLS] text [SEP] gets [CLS] in
    BOS's place and [SEP] at the end."""
    ids = hs.repeated_random_tokens(tokenizer, 1, length, seed)[0].tolist()
    if family.framing == "cls_sep":
        return [tokenizer.cls_id, *ids[1:], tokenizer.sep_id]
    return ids


def probe_note(family: Family) -> str:
    if family.framing == "cls_sep":
        return ("probe: [CLS] + n random ordinary tokens + the same n + [SEP], as the model frames a text "
                "([CLS] in place of BOS); duplicate_token and induction are the bidirectional analogues")
    if family.takes_target:
        return ("probe: BOS (<|endoftext|>) + n random ordinary tokens + the same n, read as the source; the "
                "target is the given one or the model's greedy translation of it")
    return "probe: BOS (<|endoftext|>) + n random ordinary tokens + the same n (TransformerLens's induction probe)"


def maps_bytes(family: Family, axis_lengths: dict[str, int], n_layers: int, n_heads: int) -> int:
    """The float32 maps the model side holds while it scores them: every group, every head."""
    return sum(n_layers * n_heads * axis_lengths[g.queries] * axis_lengths[g.keys] * 4 for g in family.groups)


# --- the model's side -------------------------------------------------------------------------


@dataclass
class HeadScoreResult:
    tokens: dict[str, list[int]]  # axis -> ids
    scores: dict[str, dict[str, np.ndarray]]  # group -> score -> (L, H) float64 (NaN: undefined)
    generated_target: bool = False


def group_kind(group) -> str:
    """"cross" | "causal" | "bidirectional": which definitions score a group."""
    return "cross" if group.is_cross else "causal" if group.causal else "bidirectional"


@torch.inference_mode()
def score_heads(model, ids: list[int], target_ids: list[int] | None = None) -> HeadScoreResult:
    """Runs on the model's side: the family's maps, then every group's (L, H) scores."""
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
    return HeadScoreResult(analysis.tokens, scores, analysis.generated_target)


# --- the answer -------------------------------------------------------------------------------


def _value(x: float) -> float | None:
    return None if math.isnan(x) else float(x)


def merged_definitions(family: Family) -> dict[str, str]:
    """Score -> definition over the family's groups; where groups define a score differently,
    each group's definition is given by name."""
    by_score: dict[str, dict[str, str]] = {}
    for g in family.groups:
        for name, text in hs.definitions(group_kind(g)).items():
            by_score.setdefault(name, {})[g.name] = text
    out = {}
    for name, per_group in by_score.items():
        texts = set(per_group.values())
        if len(texts) == 1 and len(per_group) == len(family.groups):
            out[name] = texts.pop()
        else:
            out[name] = " | ".join(f"{group} group: {text}" for group, text in per_group.items())
    out["role"] = hs.ROLE_DEFINITION
    return out


def atlas_answer(family: Family, result: HeadScoreResult, tokenizer, model_name: str,
                 probe: dict | None = None) -> dict:
    """The answer's fields (HeadsResponse) from the model side's scores."""
    token_list = lambda ids: [{"id": i, "text": tokenizer.display_text(i)} for i in ids]
    groups = []
    for g in family.groups:
        group_scores = result.scores[g.name]
        L, H = next(iter(group_scores.values())).shape
        heads = []
        for layer in range(L):
            row = []
            for head in range(H):
                scores = {name: _value(s[layer, head]) for name, s in group_scores.items()}
                role, role_score = hs.roles(scores)
                row.append({"layer": layer, "head": head, "scores": scores, "role": role, "role_score": role_score})
            heads.append(row)
        groups.append({"name": g.name, "causal": g.causal, "bidirectional": not g.causal and not g.is_cross,
                       "rows": AXIS_FIELD[g.queries], "columns": AXIS_FIELD[g.keys], "heads": heads,
                       "definitions": {**hs.definitions(group_kind(g)), "role": hs.ROLE_DEFINITION}})
    primary = family.primary
    notes = [probe_note(family)] if probe is not None else []
    return {
        "model": model_name, "family": family.name,
        "tokens": token_list(result.tokens[primary.queries]),
        "target_tokens": token_list(result.tokens["target"]) if family.takes_target else None,
        "generated_target": result.generated_target if family.takes_target else None,
        "probe": probe, "groups": groups, "heads": groups[0]["heads"],
        "thresholds": {role: t for role, t in hs.ROLE_THRESHOLDS.items()  # the roles this family's scores allow
                       if any(hs.ROLE_SCORE.get(role, role) in s for s in result.scores.values())}, "definitions": merged_definitions(family), "notes": notes,
    }
