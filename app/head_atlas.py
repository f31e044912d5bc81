"""The head atlas (POST /heads): every head of every attention group scored from the maps the
family's `analyse` computes, with a role per head.

    probe_ids         the repeated-random probe, framed as the family frames a text
    clark_probe       an encoder's real-text probe: the fixed English sentences of Clark et al.'s
                      scores (model/head_scores.CLARK_SENTENCES), each framed [CLS] sentence [SEP]
    score_heads       on the model's side (the engine's model-call line or a worker thread): the
                      family's `analyse`, then each group's scores (model/head_scores.py), as numpy;
                      only the (L, H) scores travel back, never the maps
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


# --- Clark et al.'s real-text probe (an encoder's) --------------------------------------------


@dataclass
class ClarkProbe:
    """The sentences Clark et al.'s scores average over, as the model side needs them: each
    framed sentence's ids and which of its tokens are punctuation (from the tokenizer's token
    strings, so worked out here, on the app's side)."""

    sentences: list[str]
    ids: list[list[int]]  # [CLS] sentence [SEP], each
    punctuation: list[list[bool]]  # per sentence, per token
    cls_id: int
    sep_id: int

    def maps_bytes(self, family: Family, n_layers: int, n_heads: int) -> int:
        """The float32 maps of its longest sentence (the sentences are analysed one at a time)."""
        return max(maps_bytes(family, {"tokens": len(ids), "source": len(ids)}, n_layers, n_heads)
                   for ids in self.ids)


def clark_groups(family: Family) -> list[str]:
    """The groups Clark et al.'s scores are given for: a [CLS] text [SEP] family's bidirectional
    self groups over its tokens (an encoder's "self")."""
    if family.framing != "cls_sep":
        return []
    return [g.name for g in family.groups if group_kind(g) == "bidirectional" and g.queries == g.keys == "tokens"]


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
def clark_scores(model, probe: ClarkProbe) -> dict[str, dict[str, torch.Tensor]]:
    """Runs on the model's side: each sentence's maps, Clark et al.'s scores of each, their mean:
    group -> score -> (L, H)."""
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
    """Runs on the model's side: the family's maps, then every group's (L, H) scores; with
    `clark`, an encoder's groups also get Clark et al.'s scores on its sentences."""
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
