"""Per-head scores of attention maps: what a head does, as numbers with one-line definitions.

One place for the definitions the evaluation report (evaluation/decoder.py) and the service's
head atlas (POST /heads) both use. Maps are (..., Q, K) probabilities, rows summing to 1; a
group of maps is (L, H, Q, K) and every score comes out (L, H).

Detection scores, TransformerLens's `head_detector.detect_head` with error_measure="mul",
exclude_bos=False, exclude_current_token=False: score = sum(map * pattern) / sum(map), with
    previous_token   key i-1 for query i
    duplicate_token  every earlier key holding the query's token
    induction        the key right after every earlier occurrence of the query's token
A causal group uses exactly these. A bidirectional group (an encoder) uses the analogues over
both directions (`bidirectional_patterns`): previous_token as is, next_token (key i+1), and
duplicate_token / induction over every *other* occurrence, before or after the query.

Shape scores over the query rows 1..T-1 of a self group (row 0 of a causal map is always [1]):
first_token (attention to key 0), self (the diagonal), entropy (the row's entropy over log of
the number of keys it can see), mean_distance (sum_j p_j |i - j|, in tokens). A cross group
(target rows over source columns) scores every row: first_token, entropy, and alignment (the
attention within one source token of the row's proportional diagonal position).

Clark et al. 2019 ("What Does BERT Look At?", section 3) measure an encoder's heads on real
text, not on a probe: each head's attention to [CLS], to [SEP], to punctuation, to the previous
and to the next token, and its rows' entropy in nats, each the mean over every query row (all T
tokens) of one text, then over the texts. `clark_text_scores` scores one text's maps,
`mean_over_texts` averages them; CLARK_SENTENCES are the fixed English sentences the service's
atlas uses (`framed_sentences` frames them as an encoder frames a text, [CLS] text [SEP]).

Roles: each candidate score over its threshold; the one furthest over (score / threshold)
wins; none over -> "mixed". See ROLE_THRESHOLDS and `roles`.
"""

from __future__ import annotations

import math
import unicodedata

import torch

# --- inputs: the repeated-random probe --------------------------------------------------------


def ordinary_ids(tokenizer) -> torch.Tensor:
    """Every id of the vocabulary that is no special token (BOS, EOS, [CLS], [SEP], [PAD], [MASK])."""
    return torch.tensor([i for i in range(tokenizer.vocab_size) if i not in tokenizer.special_ids])


def repeated_random_tokens(tokenizer, n: int, length: int, seed: int) -> torch.Tensor:
    """(n, 1 + 2*length): BOS (our <|endoftext|>), then `length` random ordinary tokens, then the
    same again; the same ids for the same seed on every machine (torch's CPU generator)."""
    ordinary = ordinary_ids(tokenizer)
    g = torch.Generator().manual_seed(seed)
    draws = ordinary[torch.randint(0, len(ordinary), (n, length), generator=g)]
    bos = torch.full((n, 1), tokenizer.eos_id, dtype=torch.long)
    return torch.cat([bos, draws, draws], dim=1)


# --- inputs: real English sentences (Clark et al.'s measures) ----------------------------------

# short, ordinary modern sentences with the usual punctuation (commas, full stops, a question
# mark, a semicolon, an apostrophe); the last holds two sentences, so a full stop falls mid-text
CLARK_SENTENCES = (
    "The bus was late again, so we walked to work.",
    "She opened the window, and cold air filled the room.",
    "After lunch, the team met to plan the next release.",
    "My brother lives in Chicago; he works at a small bakery.",
    "Can you send me Anna's report before Friday?",
    "The museum is closed on Mondays, but the park is open.",
    "We bought apples, bread, and milk at the corner store.",
    "It rained all night. By morning, the streets were flooded.",
)


def framed_sentences(tokenizer, context_length: int, sentences=CLARK_SENTENCES) -> list[list[int]]:
    """Each sentence as an encoder frames a text: [CLS] + its tokens + [SEP] (one segment; a
    sentence too long for the context keeps its first context_length - 2 tokens)."""
    keep = max(0, context_length - 2)
    return [[tokenizer.cls_id, *tokenizer.encode(s)[:keep], tokenizer.sep_id] for s in sentences]


def is_punctuation(text: str) -> bool:
    """Whether a token's text, whitespace taken off, is non-empty and only Unicode punctuation
    (every character in a category P*: Pc Pd Ps Pe Pi Pf Po)."""
    text = text.strip()
    return bool(text) and all(unicodedata.category(c).startswith("P") for c in text)


def punctuation_mask(tokenizer, ids: list[int]) -> list[bool]:
    """(T,) whether each token is punctuation: no special token, and its text (the tokenizer's
    token string as text: a byte-level token's bytes, a WordPiece token without its "##")
    `is_punctuation`."""
    special = tokenizer.special_ids
    return [i not in special and is_punctuation(tokenizer.token_bytes(i).decode("utf-8", errors="replace"))
            for i in ids]


# --- TransformerLens's detection patterns (head_detector.py) ----------------------------------


def duplicate_token_pattern(tokens: torch.Tensor) -> torch.Tensor:
    """(T,) -> (T, T): 1 where key j < query i holds the query's token (detect_head's)."""
    eq = (tokens[:, None] == tokens[None, :]).float()
    eq.fill_diagonal_(0)
    return torch.tril(eq)


def induction_pattern(tokens: torch.Tensor) -> torch.Tensor:
    """(T,) -> (T, T): the duplicate pattern shifted one key to the right, first column 0."""
    dup = duplicate_token_pattern(tokens)
    shifted = torch.zeros_like(dup)
    shifted[:, 1:] = dup[:, :-1]
    return torch.tril(shifted)


def previous_token_pattern(tokens: torch.Tensor) -> torch.Tensor:
    """(T,) -> (T, T): 1 at key i-1 of every query i >= 1."""
    T = len(tokens)
    pattern = torch.zeros(T, T)
    pattern[1:, :-1] = torch.eye(T - 1)
    return pattern


PATTERNS = {"induction": induction_pattern, "previous_token": previous_token_pattern,
            "duplicate_token": duplicate_token_pattern}


def mul_score(attention: torch.Tensor, pattern: torch.Tensor) -> torch.Tensor:
    """(..., T, T) attention and (T, T) pattern -> (...) scores: sum(attention * pattern) /
    sum(attention), detect_head's "mul" error measure."""
    return (attention * pattern).sum((-2, -1)) / attention.sum((-2, -1))


# --- the bidirectional analogues (an encoder's self-attention) --------------------------------


def next_token_pattern(tokens: torch.Tensor) -> torch.Tensor:
    """(T,) -> (T, T): 1 at key i+1 of every query i <= T-2."""
    T = len(tokens)
    pattern = torch.zeros(T, T)
    pattern[:-1, 1:] = torch.eye(T - 1)
    return pattern


def other_occurrence_pattern(tokens: torch.Tensor) -> torch.Tensor:
    """(T,) -> (T, T): 1 where key j != i holds the query's token, before or after it."""
    eq = (tokens[:, None] == tokens[None, :]).float()
    eq.fill_diagonal_(0)
    return eq


def after_other_occurrence_pattern(tokens: torch.Tensor) -> torch.Tensor:
    """(T,) -> (T, T): 1 at the key right after every other occurrence of the query's token."""
    dup = other_occurrence_pattern(tokens)
    shifted = torch.zeros_like(dup)
    shifted[:, 1:] = dup[:, :-1]
    return shifted


def causal_patterns(tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    return {name: make(tokens) for name, make in PATTERNS.items()}


def bidirectional_patterns(tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"previous_token": previous_token_pattern(tokens), "next_token": next_token_pattern(tokens),
            "duplicate_token": other_occurrence_pattern(tokens), "induction": after_other_occurrence_pattern(tokens)}


# --- shape scores -----------------------------------------------------------------------------


def row_entropy(rows: torch.Tensor) -> torch.Tensor:
    """(..., Q, K) -> (..., Q): -sum p log p, with 0 log 0 = 0 (0 * log(tiny); log(0) is slow)."""
    return -(rows * rows.clamp_min(1e-30).log()).sum(-1)


def pattern_scores(maps: torch.Tensor, patterns: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """mul_score of each (T, T) 0/1 pattern on (..., T, T) maps, reading only the pattern's cells
    (a pattern marks at most a few cells per row: no T x T products)."""
    total = maps.sum((-2, -1))
    out = {}
    for name, pattern in patterns.items():
        q, k = pattern.nonzero(as_tuple=True)
        out[name] = maps[..., q.to(maps.device), k.to(maps.device)].sum(-1) / total
    return out


def self_group_scores(maps: torch.Tensor, tokens: torch.Tensor, causal: bool) -> dict[str, torch.Tensor]:
    """(L, H, T, T) maps of a self-attention group over `tokens` (T,) -> score -> (L, H).
    Shape scores over query rows 1..T-1 are NaN when T == 1 (no such rows)."""
    maps = maps.float()
    T = maps.shape[-1]
    patterns = causal_patterns(tokens) if causal else bidirectional_patterns(tokens)
    scores = pattern_scores(maps, patterns)
    rows = maps[..., 1:, :]  # (L, H, T-1, T): query rows 1..T-1
    q = torch.arange(1, T, device=maps.device, dtype=maps.dtype)  # (T-1,) query positions
    k = torch.arange(T, device=maps.device, dtype=maps.dtype)  # (T,) key positions
    seen = q + 1 if causal else torch.full_like(q, T)  # keys each row can see (>= 2)
    scores["first_token"] = rows[..., 0].mean(-1)
    scores["self"] = torch.diagonal(maps, dim1=-2, dim2=-1)[..., 1:].mean(-1)
    scores["entropy"] = (row_entropy(rows) / torch.log(seen)).mean(-1)
    scores["mean_distance"] = (rows * (q[:, None] - k[None, :]).abs()).sum(-1).mean(-1)
    return scores


def key_attention(maps: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """(..., T, T) maps and (T,) bool marks on the keys -> (...): the attention each query row
    gives the marked keys (summed over them), averaged over every query row (0: none marked)."""
    return maps[..., keys.to(maps.device)].sum(-1).mean(-1)


def clark_text_scores(maps: torch.Tensor, tokens: torch.Tensor, cls_id: int, sep_id: int,
                      punctuation: torch.Tensor) -> dict[str, torch.Tensor]:
    """(L, H, T, T) maps of one real text over `tokens` (T,) ([CLS] ... [SEP]), with (T,) bool
    `punctuation` marks -> Clark et al.'s scores -> (L, H): each the mean over every query row
    (all T tokens, [CLS] and [SEP] rows included). clark_previous / clark_next are previous_token /
    next_token's measure (sum(map * pattern) / sum(map), the same thing: rows sum to 1)."""
    maps = maps.float()
    neighbours = pattern_scores(maps, {"clark_previous": previous_token_pattern(tokens),
                                       "clark_next": next_token_pattern(tokens)})
    return {"clark_cls": key_attention(maps, tokens == cls_id),
            "clark_sep": key_attention(maps, tokens == sep_id),
            "clark_punctuation": key_attention(maps, punctuation.bool()),
            **neighbours,
            "clark_entropy": row_entropy(maps).mean(-1)}  # nats


def mean_over_texts(per_text: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """[score -> (L, H)] of each text -> score -> (L, H): the mean over the texts."""
    return {name: torch.stack([s[name] for s in per_text]).mean(0) for name in per_text[0]}


def diagonal_positions(n_rows: int, n_columns: int) -> torch.Tensor:
    """(n_rows,) the source position round(t (S-1) / (T-1)) of each target row t (0 if T == 1)."""
    if n_rows == 1:
        return torch.zeros(1, dtype=torch.long)
    t = torch.arange(n_rows, dtype=torch.float64)
    return torch.round(t * (n_columns - 1) / (n_rows - 1)).long()


def cross_group_scores(maps: torch.Tensor) -> dict[str, torch.Tensor]:
    """(L, H, T, S) cross-attention maps (target rows over source columns) -> score -> (L, H)."""
    maps = maps.float()
    T, S = maps.shape[-2:]
    d = diagonal_positions(T, S).to(maps.device)  # (T,)
    band = ((torch.arange(S, device=maps.device)[None, :] - d[:, None]).abs() <= 1).to(maps.dtype)  # (T, S)
    entropy = row_entropy(maps) / math.log(S) if S > 1 else torch.full(maps.shape[:-1], float("nan"))
    return {"alignment": (maps * band).sum(-1).mean(-1), "first_token": maps[..., 0].mean(-1),
            "entropy": entropy.mean(-1)}


# --- definitions, roles -----------------------------------------------------------------------

TL = "TransformerLens detect_head (error_measure='mul', exclude_bos=False, exclude_current_token=False): " \
     "sum(attention * pattern) / sum(attention) over every query row and key"
CAUSAL_DEFINITIONS = {
    "previous_token": f"{TL}; pattern: key i-1 of each query i",
    "duplicate_token": f"{TL}; pattern: every earlier key holding the query's token",
    "induction": f"{TL}; pattern: the key right after every earlier occurrence of the query's token "
                 "(about 0.5 at most on the probe: only the second copy's rows can score)",
}
BIDIRECTIONAL_DEFINITIONS = {
    "previous_token": f"{TL}; pattern: key i-1 of each query i (as for a causal group)",
    "next_token": "bidirectional analogue of previous_token: the same measure, pattern key i+1 of each query i",
    "duplicate_token": "bidirectional analogue of detect_head's duplicate_token: the same measure, pattern every "
                       "OTHER key holding the query's token, before or after it",
    "induction": "bidirectional analogue of detect_head's induction: the same measure, pattern the key right after "
                 "every OTHER occurrence of the query's token, before or after it (on the probe each copy's "
                 "rows can score, about 1.0 at most)",
}
SHAPE_DEFINITIONS = {
    "first_token": "mean attention to key 0 over query rows 1..T-1",
    "self": "mean attention of a query to itself (the diagonal) over query rows 1..T-1",
    "entropy": "mean over query rows 1..T-1 of the row's entropy divided by log(number of keys the row can see): "
               "0 = one key, 1 = uniform",
    "mean_distance": "mean over query rows 1..T-1 of sum_j attention[i, j] * |i - j|, in tokens",
}
CROSS_DEFINITIONS = {
    "alignment": "mean over target rows t (of T) of the attention on the source positions within 1 of the "
                 "proportional diagonal d(t) = round(t * (S-1) / (T-1)) (S source tokens): 1 = every row on a "
                 "monotone, length-proportional alignment; a head fixed on one source position scores low",
    "first_token": "mean attention to source position 0 over every target row",
    "entropy": "mean over target rows of the row's entropy divided by log(S): 0 = one source token, 1 = uniform",
}

CLARK = ("Clark et al. 2019 ('What Does BERT Look At?'), on fixed English sentences (clark_sentences), not on "
         "the input: each framed [CLS] sentence [SEP]; the mean over every query row (all T tokens, [CLS] and "
         "[SEP] included), then over the sentences, of")
CLARK_DEFINITIONS = {
    "clark_cls": f"{CLARK} the attention given to [CLS]",
    "clark_sep": f"{CLARK} the attention given to [SEP] tokens (summed over them)",
    "clark_punctuation": f"{CLARK} the attention given to punctuation tokens (summed over them): tokens, no special "
                         "one, whose text (whitespace and a WordPiece '##' taken off) is only Unicode punctuation "
                         "(categories P*: . , ; ? ' and the like)",
    "clark_previous": f"{CLARK} the attention of query i to key i-1 (row 0 gives 0): previous_token's measure",
    "clark_next": f"{CLARK} the attention of query i to key i+1 (the last row gives 0): next_token's measure",
    "clark_entropy": f"{CLARK} the row's entropy in nats, -sum p ln p (0: one key; ln T: uniform over T keys; "
                     "Clark smooths p first, here 0 ln 0 = 0): low = focused, high = broad",
}


def definitions(kind: str, clark: bool = False) -> dict[str, str]:
    """The one-line definition of each score a group of this kind ("causal" | "bidirectional" |
    "cross") carries; `clark`: with Clark et al.'s real-text scores (an encoder's self group)."""
    if kind == "cross":
        return dict(CROSS_DEFINITIONS)
    out = {**(CAUSAL_DEFINITIONS if kind == "causal" else BIDIRECTIONAL_DEFINITIONS), **SHAPE_DEFINITIONS}
    return {**out, **CLARK_DEFINITIONS} if clark else out


# role -> (the score it reads, its threshold)
# (cls, sep, punctuation: an encoder's, from Clark et al.'s scores on the fixed sentences)
ROLE_THRESHOLDS = {"previous_token": 0.3, "next_token": 0.3, "duplicate_token": 0.2, "induction": 0.2,
                   "first_token": 0.5, "self": 0.4, "broad": 0.85, "alignment": 0.5,
                   "cls": 0.5, "sep": 0.5, "punctuation": 0.3}
# every other role reads the score of its own name
ROLE_SCORE = {"broad": "entropy", "cls": "clark_cls", "sep": "clark_sep", "punctuation": "clark_punctuation"}
ROLE_DEFINITION = ("a head's role is the candidate whose score is furthest over its threshold (largest "
                   "score / threshold); role_score is that score; 'broad' reads entropy; with none over, the "
                   "role is 'mixed' and role_score the score nearest its threshold (largest score / threshold)")
CLARK_ROLE_DEFINITION = ("; 'cls', 'sep' and 'punctuation' (attends to [CLS], to [SEP], to punctuation) read "
                         "clark_cls, clark_sep and clark_punctuation, Clark et al.'s scores on the fixed sentences")


def role_definition(clark: bool = False) -> str:
    return ROLE_DEFINITION + (CLARK_ROLE_DEFINITION if clark else "")


def roles(scores: dict[str, float | None], thresholds: dict[str, float] = ROLE_THRESHOLDS) -> tuple[str, float | None]:
    """(role, role_score) of one head from its scores (None = undefined)."""
    best, best_ratio, best_score = "mixed", -1.0, None
    for role, threshold in thresholds.items():
        value = scores.get(ROLE_SCORE.get(role, role))
        if value is None or math.isnan(value):
            continue
        ratio = value / threshold
        if ratio > best_ratio:
            best, best_ratio, best_score = role, ratio, value
    if best_ratio < 1.0:
        return "mixed", best_score
    return best, best_score
