"""The head atlas (POST /heads): every head of every attention group scored from the maps the
family's `analyse` computes, with a role per head.

    probe_ids         the repeated-random probe, framed as the family frames a text
    clark_probe       an encoder's real-text probe: the fixed English sentences of Clark et al.'s
                      scores (model/analysis/head_scores.CLARK_SENTENCES), each framed [CLS] sentence [SEP]
    maps_bytes        the float32 maps the model side holds while it scores them (what a request
                      claims); the scoring itself is the model side's (HeadScoresCall:
                      model/analysis/head_atlas_scores.py), and only the (L, H) scores travel back
    atlas_answer      on a worker thread: the answer's fields (tokens, groups, roles, definitions)

A group is scored by what the family declares about it (model/families/contract.py): a cross
group (queries on another axis than keys) gets the cross scores; a causal self group
TransformerLens's detection scores; any other self group their bidirectional analogues. An
encoder's (a [CLS] text [SEP] family's) bidirectional self groups also get Clark et al.'s scores
(clark_*), on the fixed sentences whatever the input: they name the heads that attend to [CLS],
[SEP], punctuation, the previous or next token, or broadly.
"""

from __future__ import annotations

import math

import numpy as np

from attnlens.model import Family
from attnlens.model.analysis import head_scores as hs
from attnlens.model.analysis.head_atlas_scores import ClarkProbe, HeadScoreResult, clark_groups, group_kind

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
    """BOS + n random ordinary tokens + the same n (model/analysis/head_scores.repeated_random_tokens, the
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


# --- Clark et al.'s real-text probe (an encoder's) --------------------------------------------


def clark_maps_bytes(probe: ClarkProbe, family: Family, n_layers: int, n_heads: int) -> int:
    """The float32 maps of the probe's longest sentence (the sentences are analysed one at a time)."""
    return max(maps_bytes(family, {"tokens": len(ids), "source": len(ids)}, n_layers, n_heads) for ids in probe.ids)


def clark_probe(family: Family, tokenizer, context_length: int) -> ClarkProbe | None:
    """The fixed sentences framed as the family frames a text (None: a family without Clark's scores)."""
    if not clark_groups(family) or tokenizer.cls_id is None or tokenizer.sep_id is None:
        return None
    sentences = list(hs.CLARK_SENTENCES)
    ids = hs.framed_sentences(tokenizer, context_length, sentences)
    return ClarkProbe(sentences, ids, [hs.punctuation_mask(tokenizer, i) for i in ids],
                      tokenizer.cls_id, tokenizer.sep_id)


def clark_note(probe: ClarkProbe) -> str:
    return (f"clark_* scores (Clark et al. 2019): over {len(probe.sentences)} fixed English sentences "
            "(clark_sentences), each framed [CLS] sentence [SEP] and analysed on its own; the same whatever "
            "the input")


# --- the answer -------------------------------------------------------------------------------


def _value(x: float) -> float | None:
    return None if math.isnan(x) else float(x)


def has_clark(group_scores: dict[str, np.ndarray]) -> bool:
    return "clark_cls" in group_scores


def merged_definitions(family: Family, clark: frozenset[str] | set[str] = frozenset()) -> dict[str, str]:
    """Score -> definition over the family's groups (`clark`: the groups with Clark et al.'s
    scores); where groups define a score differently, each group's definition is given by name."""
    by_score: dict[str, dict[str, str]] = {}
    for g in family.groups:
        for name, text in hs.definitions(group_kind(g), g.name in clark).items():
            by_score.setdefault(name, {})[g.name] = text
    out = {}
    for name, per_group in by_score.items():
        texts = set(per_group.values())
        if len(texts) == 1 and len(per_group) == len(family.groups):
            out[name] = texts.pop()
        else:
            out[name] = " | ".join(f"{group} group: {text}" for group, text in per_group.items())
    out["role"] = hs.role_definition(bool(clark))
    return out


def atlas_answer(family: Family, result: HeadScoreResult, tokenizer, model_name: str,
                 probe: dict | None = None, clark: ClarkProbe | None = None) -> dict:
    """The answer's fields (HeadsResponse) from the model side's scores (`clark`: the sentences
    Clark et al.'s scores, if the result has them, were taken on)."""
    clark_named = {g.name for g in family.groups if has_clark(result.scores[g.name])}
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
                       "definitions": {**hs.definitions(group_kind(g), g.name in clark_named),
                                       "role": hs.role_definition(g.name in clark_named)}})
    primary = family.primary
    notes = [probe_note(family)] if probe is not None else []
    if clark_named and clark is not None:
        notes.append(clark_note(clark))
    return {
        "model": model_name, "family": family.name,
        "tokens": token_list(result.tokens[primary.queries]),
        "target_tokens": token_list(result.tokens["target"]) if family.takes_target else None,
        "generated_target": result.generated_target if family.takes_target else None,
        "probe": probe, "groups": groups, "heads": groups[0]["heads"],
        "thresholds": {role: t for role, t in hs.ROLE_THRESHOLDS.items()  # the roles this family's scores allow
                       if any(hs.ROLE_SCORE.get(role, role) in s for s in result.scores.values())},
        "definitions": merged_definitions(family, clark_named), "notes": notes,
        "clark_sentences": list(clark.sentences) if clark_named and clark is not None else None,
    }
