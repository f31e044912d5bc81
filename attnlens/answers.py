"""Typed answers of the attnlens API, built from its JSON (numpy for the maps, nothing heavier).

Attention maps are always [layer][head][query][key]: `Attention.maps` is a float32 array of
that shape holding the layers and heads the answer was asked for (`layers`, `heads` say which),
decoded from whichever format and packing the server sent.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from .ablation import Ablation
from .codec import decode, decode_positions


@dataclass(frozen=True)
class Token:
    """One position: its token id and its text (whitespace as it is)."""

    id: int
    text: str

    @classmethod
    def from_json(cls, d: dict) -> Token:
        return cls(int(d["id"]), d["text"])


def _tokens(items: list[dict]) -> list[Token]:
    return [Token.from_json(t) for t in items]


def _along(along: dict[str, list[Token] | None], axis: str) -> list[Token]:
    """A group's rows or columns: the tokens along its axis (an answer with a group over the target
    carries the target's tokens)."""
    tokens = along[axis]
    assert tokens is not None, f"no tokens along {axis!r}"
    return tokens


def _number(value: Any) -> float:
    return np.nan if value is None else float(value)


def _numbers(values: list) -> np.ndarray:
    """Floats with None as nan."""
    return np.array([_number(v) for v in values], dtype=np.float64)


def _ablations(body: dict) -> list[Ablation] | None:
    return None if body.get("ablate") is None else [Ablation.from_json(a) for a in body["ablate"]]


# --- /attention ----------------------------------------------------------------------------
def _reduced(fields: dict) -> dict:
    """A group's window, bins and top-k positions, as its answer states them."""
    span = lambda name: None if fields.get(name) is None else (int(fields[name][0]), int(fields[name][1]))
    edges = lambda name: None if fields.get(name) is None else [int(e) for e in fields[name]]
    return {"query_range": span("rows"), "key_range": span("cols"), "row_edges": edges("row_edges"),
            "col_edges": edges("col_edges"), "positions": decode_positions(fields)}


@dataclass(frozen=True, eq=False)
class AttentionGroup:
    """One group of maps: `maps` [layers][heads][rows][cols]; rows attend to columns.

    Named as the model's family declares them (the answer's `groups`, GET /models' family_info):
    a decoder's and an encoder's one group is "self"; an encoder-decoder has three: "encoder"
    (source over source), "decoder" (target over target, causal) and "cross" (target rows over
    source columns). `queries` / `keys` are the axes the rows and columns run over."""

    name: str
    maps: np.ndarray  # (L', H', rows, cols) float32; pooled (.., Nr, Nc); top-k weights (.., rows, k)
    rows: list[Token]
    cols: list[Token]
    causal: bool  # zero above the diagonal
    queries: str = "tokens"  # the rows' axis: tokens | source | target
    keys: str = "tokens"  # the columns' axis
    query_range: tuple[int, int] | None = None  # [a, b): the query positions the maps cover (a window)
    key_range: tuple[int, int] | None = None  # [c, d): the key positions
    row_edges: list[int] | None = None  # pool: row bin i is query positions edges[i] .. edges[i+1]-1
    col_edges: list[int] | None = None  # pool: the key bins
    positions: np.ndarray | None = None  # top_k: (L', H', rows, k) key positions, heaviest first; -1 none

    @property
    def kind(self) -> str:
        """What `maps` holds: "map" (full resolution, perhaps a window), "pool" or "top_k"."""
        return "pool" if self.row_edges is not None else "top_k" if self.positions is not None else "map"


@dataclass(frozen=True)
class GroupSpec:
    """A declared attention group: its name, axes and causality (an answer's `groups` entry)."""

    name: str
    queries: str
    keys: str
    causal: bool

    @classmethod
    def from_json(cls, d: dict) -> GroupSpec:
        return cls(d["name"], d["queries"], d["keys"], bool(d["causal"]))


@dataclass(frozen=True, eq=False)
class Attention:
    """An /attention answer. `maps` is [layers][heads][query][key] for the held `layers` and
    `heads` (model indices: maps[i, j] is layer layers[i], head heads[j]); `head(l, h)` takes
    model indices. `groups` has the maps by their declared name, the primary one (`maps`, over
    `tokens`) first: a decoder's or an encoder's "self"; an encoder-decoder's "encoder" (over the
    source), "decoder" and "cross", with `target_tokens` the decoder's rows."""

    model: str
    family: str  # the family's name (decoder, encoder, encoder-decoder, ...)
    direction: str  # the family's attention kind: causal | bidirectional | encoder-decoder
    tokens: list[Token]
    n_layers: int
    n_heads: int
    layers: list[int]
    heads: list[int]
    format: str  # the format it came in: json | f16 | u8
    maps: np.ndarray  # (len(layers), len(heads), T, T) float32
    groups: dict[str, AttentionGroup]
    text: str | None = None  # the analysed text, when a text (not ids) was asked for
    target_tokens: list[Token] | None = None  # encoder-decoder: the decoder's start token, then the target
    generated: bool | None = None  # encoder-decoder: the target is the model's own greedy translation
    ablate: list[Ablation] | None = None  # the heads ablated (groups resolved), when the request ablated any

    @classmethod
    def from_json(cls, body: dict, *, text: str | None = None) -> Attention:
        """From an /attention answer in any format and packing: its `groups` say what it holds."""
        specs = [GroupSpec.from_json(g) for g in body["groups"]]
        translation = body.get("translation") or {}
        return cls.from_arrays(
            model=body["model"], family=body["family"], direction=body["direction"],
            tokens=_tokens(body["tokens"]), n_layers=body["n_layers"], n_heads=body["n_heads"],
            layers=list(body["layers"]), heads=list(body["heads"]), format=body["format"], text=text,
            specs=specs, maps={specs[0].name: decode(body), **{s.name: decode(translation[s.name]) for s in specs[1:]}},
            reduced={specs[0].name: _reduced(body), **{s.name: _reduced(translation[s.name]) for s in specs[1:]}},
            target_tokens=_tokens(translation["target_tokens"]) if "target_tokens" in translation else None,
            generated=bool(translation["generated"]) if "generated" in translation else None,
            ablate=_ablations(body))

    @classmethod
    def from_arrays(cls, *, model: str, family: str, direction: str, tokens: list[Token], n_layers: int,
                    n_heads: int, layers: list[int], heads: list[int], format: str, specs: list[GroupSpec],
                    maps: dict[str, np.ndarray], text: str | None = None, target_tokens: list[Token] | None = None,
                    generated: bool | None = None, ablate: list[Ablation] | None = None,
                    reduced: dict[str, dict] | None = None) -> Attention:
        """From maps in hand, group by group (`specs`, the primary first, over `tokens`; a group
        over the target axis has `target_tokens` as its rows or columns). `reduced`: a group's
        query_range, key_range, row_edges, col_edges, positions (a window, pooled or top-k maps)."""
        along = {"tokens": tokens, "source": tokens, "target": target_tokens}
        reduced = reduced or {}
        groups = {s.name: AttentionGroup(s.name, np.asarray(maps[s.name], dtype=np.float32), _along(along, s.queries),
                                         _along(along, s.keys), s.causal, s.queries, s.keys, **reduced.get(s.name, {}))
                  for s in specs}
        return cls(model, family, direction, tokens, n_layers, n_heads, list(layers), list(heads), format,
                   groups[specs[0].name].maps, groups, text, target_tokens, generated, ablate)

    def axes(self) -> set[str]:
        """Every axis the answer's groups run over."""
        return {a for g in self.groups.values() for a in (g.queries, g.keys)}

    @property
    def T(self) -> int:
        return len(self.tokens)

    @property
    def encoder(self) -> AttentionGroup:
        return self._group("encoder")

    @property
    def decoder(self) -> AttentionGroup:
        return self._group("decoder")

    @property
    def cross(self) -> AttentionGroup:
        return self._group("cross")

    def _group(self, name: str) -> AttentionGroup:
        if name not in self.groups:
            raise AttributeError(f"a {self.family}'s answer has no {name!r} group (it has {', '.join(self.groups)})")
        return self.groups[name]

    def index(self, layer: int, head: int) -> tuple[int, int]:
        """Positions in `maps` of model layer `layer` and head `head` (KeyError if not held)."""
        if layer not in self.layers:
            raise KeyError(f"layer {layer} is not in this answer (it holds layers {self.layers})")
        if head not in self.heads:
            raise KeyError(f"head {head} is not in this answer (it holds heads {self.heads})")
        return self.layers.index(layer), self.heads.index(head)

    def head(self, layer: int, head: int, group: str | None = None) -> np.ndarray:
        """One head's map (rows x cols) by model indices, of `group` (default: the top-level maps)."""
        i, j = self.index(layer, head)
        maps = self.maps if group is None else self._group(group).maps
        return maps[i, j]

    def to_bertviz(self, view: Literal["head", "model"] = "head") -> dict[str, Any]:
        """Keyword arguments for bertviz: `head_view(**a.to_bertviz())`, `model_view(**a.to_bertviz("model"))`.

        bertviz indexes layers and heads by position in what it is given and labels them with
        `include_layers` / `include_heads`, so every layer of the model gets a place ([1, heads,
        rows, cols] torch tensors; zeros for the ones this answer does not hold) and only the held
        ones are included, under their own numbers. Needs torch (as bertviz does)."""
        from .bertviz import bertviz_arguments

        return bertviz_arguments(self, view)

    def __repr__(self) -> str:
        groups = ", ".join(f"{g.name} {tuple(g.maps.shape)}" for g in self.groups.values())
        return (f"Attention(model={self.model!r}, family={self.family!r}, T={self.T}, layers={self.layers}, "
                f"heads={self.heads}, format={self.format!r}, groups: {groups})")


# --- /generate -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Alternative:
    id: int
    text: str
    logprob: float


@dataclass(frozen=True, eq=False)
class GeneratedToken:
    """A generated token: id, text, logprob, its alternatives, and with return_attention its
    attention row [layers][heads][positions] (an encoder-decoder's also its cross-attention row
    over the source)."""

    id: int
    text: str
    logprob: float
    top_logprobs: list[Alternative] = field(default_factory=list)
    index: int | None = None  # streamed tokens: position in the generation
    delta: str | None = None  # streamed tokens: the exact text this token adds
    attention: np.ndarray | None = field(default=None, repr=False)  # (n_layers, n_heads, positions)
    cross_attention: np.ndarray | None = field(default=None, repr=False)  # (n_layers, n_heads, source positions)

    @classmethod
    def from_json(cls, d: dict, attention: Any = None, cross_attention: Any = None) -> GeneratedToken:
        attention = d.get("attention", attention)
        cross = d.get("cross_attention", cross_attention)
        return cls(int(d["id"]), d["text"], float(d["logprob"]),
                   [Alternative(int(a["id"]), a["text"], float(a["logprob"])) for a in d.get("top_logprobs", [])],
                   d.get("index"), d.get("delta"),
                   None if attention is None else np.asarray(attention, dtype=np.float32),
                   None if cross is None else np.asarray(cross, dtype=np.float32))


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass(frozen=True)
class Timings:
    queue_ms: float
    prefill_ms: float
    decode_ms: float
    tokens_per_second: float
    time_to_first_token_ms: float


@dataclass(frozen=True, eq=False)
class Generation:
    """A /generate answer: the text, the prompt's tokens, each generated token, why it ended."""

    id: str
    model: str
    text: str
    prompt_tokens: list[Token]
    tokens: list[GeneratedToken]
    finish_reason: str  # length | stop | eos
    usage: Usage
    timings: Timings
    ablate: list[Ablation] | None = None  # the heads ablated (groups resolved)

    @classmethod
    def from_json(cls, body: dict) -> Generation:
        rows = body.get("attention") or [None] * len(body["tokens"])
        cross = body.get("cross_attention") or [None] * len(body["tokens"])
        return cls(body["id"], body["model"], body["text"], _tokens(body["prompt_tokens"]),
                   [GeneratedToken.from_json(t, a, c) for t, a, c in zip(body["tokens"], rows, cross)],
                   body["finish_reason"], Usage(**body["usage"]), Timings(**body["timings"]), _ablations(body))

    @property
    def ids(self) -> list[int]:
        """The whole sequence's token ids (prompt, then generated): /attention's `ids` for it."""
        return [t.id for t in self.prompt_tokens] + [t.id for t in self.tokens]


@dataclass(frozen=True)
class StreamDone:
    """A stream's last event: why it ended, the prompt's tokens, the whole text, usage, timings."""

    id: str
    finish_reason: str
    prompt_tokens: list[Token]
    text: str
    delta: str  # text no token event carried (usually empty)
    usage: Usage
    timings: Timings
    ablate: list[Ablation] | None = None  # the heads ablated (groups resolved)

    @classmethod
    def from_json(cls, body: dict) -> StreamDone:
        return cls(body["id"], body["finish_reason"], _tokens(body["prompt_tokens"]), body["text"],
                   body.get("delta", ""), Usage(**body["usage"]), Timings(**body["timings"]), _ablations(body))


# --- /models, /fill-mask, /classify ------------------------------------------------------------
@dataclass(frozen=True)
class ModelSummary:
    """One loaded model (GET /models): pass `name` as a request's `model`."""

    name: str
    family: str
    default: bool
    n_layers: int
    n_heads: int
    d_model: int
    context_length: int
    vocab_size: int
    parameters: int
    tasks: list[str]
    attention: str  # causal | bidirectional | encoder-decoder
    labels: list[str] | None = None
    pooling: str | None = None
    family_info: dict | None = None  # the family's declaration (its attention groups and axes), when the server gives it
    # a generating model's recommended sampling ({"temperature", "top_p", "top_k", ...}): what a generation
    # that leaves those unset gets
    sampling_defaults: dict | None = None

    @classmethod
    def from_json(cls, d: dict) -> ModelSummary:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class FillMaskCandidate:
    """As Hugging Face's fill-mask pipeline: score, token id, token_str, the completed sequence."""

    score: float
    token: int
    token_str: str
    sequence: str


@dataclass(frozen=True)
class FillMask:
    """A /fill-mask answer: one candidate list per [MASK], in text order, best first."""

    model: str
    text: str
    masks: list[list[FillMaskCandidate]]

    @classmethod
    def from_json(cls, body: dict, text: str) -> FillMask:
        return cls(body["model"], text, [[FillMaskCandidate(**c) for c in row] for row in body["masks"]])


@dataclass(frozen=True)
class LabelScore:
    label: str
    score: float


@dataclass(frozen=True)
class Classification:
    """A /classify answer: every label's probability, highest first."""

    model: str
    text: str
    labels: list[LabelScore]

    @classmethod
    def from_json(cls, body: dict, text: str) -> Classification:
        return cls(body["model"], text, [LabelScore(l["label"], float(l["score"])) for l in body["labels"]])

    @property
    def label(self) -> str:
        """The most probable label."""
        return self.labels[0].label


@dataclass(frozen=True)
class Embeddings:
    """A /v1/embeddings answer: one unit-length sentence embedding per input, in input order."""

    model: str
    vectors: np.ndarray  # (inputs, width) float32, each row of norm 1
    prompt_tokens: int  # tokens the encoder read, [CLS] and [SEP] included

    @classmethod
    def from_json(cls, body: dict) -> Embeddings:
        rows = sorted(body["data"], key=lambda d: d["index"])
        vectors = np.stack([_embedding(d["embedding"]) for d in rows]) if rows else np.zeros((0, 0), np.float32)
        return cls(body["model"], vectors, int(body["usage"]["prompt_tokens"]))


def _embedding(value: list[float] | str) -> np.ndarray:
    """One embedding as OpenAI sends it: a list of numbers, or base64 of little-endian float32 bytes."""
    if isinstance(value, str):
        return np.frombuffer(base64.b64decode(value), dtype="<f4").astype(np.float32)
    return np.asarray(value, dtype=np.float32)


# --- /heads: the head atlas ------------------------------------------------------------------
@dataclass(frozen=True)
class RankedHead:
    """One head by one score (HeadAtlas.top): its model indices, the score and the head's role."""

    layer: int
    head: int
    score: float
    role: str


@dataclass(frozen=True, eq=False)
class HeadGroupScores:
    """One attention group's heads: `scores[name]` is a [layers, heads] float array (nan where the
    score is undefined for this input), `roles[layer][head]` and `role_scores` [layers, heads] the
    role each head got and the score it got it for. `rows` / `columns` are the tokens its query
    rows and key columns run over."""

    name: str
    causal: bool
    bidirectional: bool
    rows: list[Token]
    columns: list[Token]
    scores: dict[str, np.ndarray]
    roles: list[list[str]]
    role_scores: np.ndarray
    definitions: dict[str, str]

    @classmethod
    def from_json(cls, g: dict, along: dict[str, list[Token] | None]) -> HeadGroupScores:
        heads = g["heads"]
        names = list(heads[0][0]["scores"]) if heads and heads[0] else []
        grid = lambda value: np.array([[_number(value(h)) for h in row] for row in heads], dtype=np.float64)
        return cls(g["name"], bool(g["causal"]), bool(g["bidirectional"]), _along(along, g["rows"]),
                   _along(along, g["columns"]),
                   {s: grid(lambda h, s=s: h["scores"].get(s)) for s in names},
                   [[h["role"] for h in row] for row in heads], grid(lambda h: h["role_score"]),
                   dict(g.get("definitions", {})))

    @property
    def shape(self) -> tuple[int, int]:
        """(layers, heads)."""
        return self.role_scores.shape

    def top(self, score: str, k: int = 5) -> list[RankedHead]:
        """The k heads with the highest `score` (undefined ones last out), strongest first."""
        if score not in self.scores:
            raise KeyError(f"the {self.name!r} group has no score {score!r} (it has {', '.join(self.scores)})")
        values = self.scores[score]
        order = sorted(((v, l, h) for (l, h), v in np.ndenumerate(values) if not np.isnan(v)),
                       key=lambda t: (-t[0], t[1], t[2]))
        return [RankedHead(l, h, float(v), self.roles[l][h]) for v, l, h in order[:k]]


@dataclass(frozen=True, eq=False)
class HeadAtlas:
    """A /heads answer: every head of every attention group scored on one input, with a role each.

    `groups` by name (a decoder's and an encoder's "self"; the translator's "encoder", "decoder",
    "cross"), the first one's also as `scores`, `roles`, `role_scores` and `top()`. `thresholds`
    say what each role's score had to reach, `definitions` what each score is."""

    model: str
    family: str
    tokens: list[Token]
    groups: dict[str, HeadGroupScores]
    thresholds: dict[str, float]
    definitions: dict[str, str]
    target_tokens: list[Token] | None = None
    generated_target: bool | None = None
    probe: dict | None = None  # {"kind", "length", "seed"} when the probe was scored
    notes: list[str] = field(default_factory=list)
    clark_sentences: list[str] | None = None  # an encoder: the sentences its clark_* scores average over

    @classmethod
    def from_json(cls, body: dict) -> HeadAtlas:
        tokens = _tokens(body["tokens"])
        target = _tokens(body["target_tokens"]) if body.get("target_tokens") is not None else None
        along = {"tokens": tokens, "target_tokens": target}
        groups = [HeadGroupScores.from_json(g, along) for g in body["groups"]]
        return cls(body["model"], body["family"], tokens, {g.name: g for g in groups}, dict(body["thresholds"]),
                   dict(body["definitions"]), target, body.get("generated_target"), body.get("probe"),
                   list(body.get("notes", [])), body.get("clark_sentences"))

    @property
    def first(self) -> HeadGroupScores:
        return next(iter(self.groups.values()))

    @property
    def scores(self) -> dict[str, np.ndarray]:
        return self.first.scores

    @property
    def roles(self) -> list[list[str]]:
        return self.first.roles

    @property
    def role_scores(self) -> np.ndarray:
        return self.first.role_scores

    def top(self, score: str, k: int = 5, group: str | None = None) -> list[RankedHead]:
        """The k strongest heads by `score` in `group` (default: the first), strongest first."""
        if group is not None and group not in self.groups:
            raise KeyError(f"this answer has no group {group!r} (it has {', '.join(self.groups)})")
        return (self.first if group is None else self.groups[group]).top(score, k)

    def __repr__(self) -> str:
        groups = ", ".join(f"{g.name} {g.shape}" for g in self.groups.values())
        return f"HeadAtlas(model={self.model!r}, family={self.family!r}, T={len(self.tokens)}, groups: {groups})"


# --- /logits -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenProb:
    id: int
    text: str
    prob: float

    @classmethod
    def from_json(cls, d: dict) -> TokenProb:
        return cls(int(d["id"]), d["text"], float(d["prob"]))


@dataclass(frozen=True)
class PositionLogits:
    """What the model predicts at one position: the top tokens, and of `next` (the token that comes
    next; an encoder's: the token at the position) its probability and log-probability."""

    position: int
    token: Token
    next: Token | None
    top: list[TokenProb]
    next_prob: float | None
    next_logprob: float | None

    @classmethod
    def from_json(cls, d: dict) -> PositionLogits:
        return cls(int(d["position"]), Token.from_json(d["token"]),
                   None if d["next"] is None else Token.from_json(d["next"]),
                   [TokenProb.from_json(t) for t in d["top"]], d["next_prob"], d["next_logprob"])


@dataclass(frozen=True, eq=False)
class LogitsEffect:
    """What an ablation changed, per position: `kl` = KL(clean || ablated) in nats and
    `delta_logprob` = ablated - clean log-probability of the actual next token (nan where there
    is none, e.g. a decoder's last position)."""

    position: np.ndarray  # (P,) int
    kl: np.ndarray  # (P,) float
    delta_logprob: np.ndarray  # (P,) float, nan where undefined

    @classmethod
    def from_json(cls, rows: list[dict]) -> LogitsEffect:
        return cls(np.array([r["position"] for r in rows], dtype=np.int64), _numbers([r["kl"] for r in rows]),
                   _numbers([r["delta_logprob"] for r in rows]))


@dataclass(frozen=True, eq=False)
class LogitsAnswer:
    """A /logits answer. `positions` per position scored (with `ablate`: the ablated model's);
    with `ablate` also `clean` (the same without it) and `effect` (kl, delta_logprob arrays).
    `predicts` is "next" (an LM head) or "same" (an encoder's masked-LM head); the translator's
    positions are its `target_tokens`."""

    model: str
    family: str
    predicts: str
    head: str
    tokens: list[Token]
    positions: list[PositionLogits]
    target_tokens: list[Token] | None = None
    generated: bool | None = None
    ablate: list[Ablation] | None = None
    clean: list[PositionLogits] | None = None
    effect: LogitsEffect | None = None

    @classmethod
    def from_json(cls, body: dict) -> LogitsAnswer:
        rows = lambda items: None if items is None else [PositionLogits.from_json(p) for p in items]
        return cls(body["model"], body["family"], body["predicts"], body["head"], _tokens(body["tokens"]),
                   [PositionLogits.from_json(p) for p in body["positions"]],
                   _tokens(body["target_tokens"]) if body.get("target_tokens") is not None else None,
                   body.get("generated"), _ablations(body), rows(body.get("clean")),
                   None if body.get("effect") is None else LogitsEffect.from_json(body["effect"]))

    @property
    def next_logprob(self) -> np.ndarray:
        """(P,) the actual next token's log-probability per position (nan where none)."""
        return _numbers([p.next_logprob for p in self.positions])

    @property
    def next_prob(self) -> np.ndarray:
        return _numbers([p.next_prob for p in self.positions])

    def __repr__(self) -> str:
        ablated = f", ablate={[str(a) for a in self.ablate]}" if self.ablate else ""
        return (f"LogitsAnswer(model={self.model!r}, positions={len(self.positions)}, "
                f"predicts={self.predicts!r}{ablated})")


# --- /lens -------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class LensAnswer:
    """A /lens answer: one row per point of the residual stream (`labels`: "embeddings", then
    "block 0".."block L-1"; `indices` -1, 0..L-1), one column per position read (`columns`: their
    indices in the stream, every position unless the request named some; `positions`: the
    stream's tokens, a decoder's or encoder's tokens, the translator's target_tokens).

    `top[row][column]` the top-k tokens, `top1` their first as a [rows][P] grid of Tokens and
    `prob` [rows, P] its probability; `actual[column]` the token the position predicts (see
    `predicts`; None where there is none), `actual_prob` [rows, P] its probability (nan where
    none) and, when the request asked for `rank`, `actual_rank` [rows, P] its rank (0 = top; -1
    where none; None when not asked). The last row is the model's output."""

    model: str
    family: str
    predicts: str
    head: str
    tokens: list[Token]
    labels: list[str]
    indices: list[int]
    top: list[list[list[TokenProb]]]
    actual: list[Token | None]
    actual_rank: np.ndarray | None  # (rows, P) int, -1 where none; None: not asked for
    actual_prob: np.ndarray  # (rows, P) float, nan where none
    columns: list[int]  # the stream positions read, in the order of the answer's columns
    target_tokens: list[Token] | None = None
    generated: bool | None = None
    ablate: list[Ablation] | None = None

    @classmethod
    def from_json(cls, body: dict) -> LensAnswer:
        layers = body["layers"]
        first = layers[0]["positions"] if layers else []
        actual = [None if p["actual"] is None else Token.from_json(p["actual"]) for p in first]
        grid = lambda key, empty, dtype: np.array(
            [[empty if p["actual"] is None else p["actual"][key] for p in row["positions"]] for row in layers],
            dtype=dtype).reshape(len(layers), len(first))
        ranked = any(p["actual"] is not None and p["actual"]["rank"] is not None for p in first)
        return cls(body["model"], body["family"], body["predicts"], body["head"], _tokens(body["tokens"]),
                   [row["label"] for row in layers], [int(row["index"]) for row in layers],
                   [[[TokenProb.from_json(t) for t in p["top"]] for p in row["positions"]] for row in layers],
                   actual, grid("rank", -1, np.int64) if ranked else None, grid("prob", np.nan, np.float64),
                   [int(p["position"]) for p in first],
                   _tokens(body["target_tokens"]) if body.get("target_tokens") is not None else None,
                   body.get("generated"), _ablations(body))

    @property
    def positions(self) -> list[Token]:
        """The tokens the columns are: the translator's target_tokens, else tokens."""
        return self.tokens if self.target_tokens is None else self.target_tokens

    @property
    def top1(self) -> list[list[Token]]:
        """[rows][T]: each row's most likely token at each position."""
        return [[Token(p[0].id, p[0].text) for p in row] for row in self.top]

    @property
    def prob(self) -> np.ndarray:
        """(rows, T): the probability of top1."""
        return np.array([[p[0].prob for p in row] for row in self.top], dtype=np.float64).reshape(
            len(self.top), len(self.actual))

    def __repr__(self) -> str:
        return f"LensAnswer(model={self.model!r}, rows={len(self.labels)}, columns={len(self.actual)})"


# --- /attention/explain ------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Recomputed:
    """HeadExplanation.recompute(): the attention row and the head's output, from q, keys, values."""

    softmax: np.ndarray  # (keys,)
    z: np.ndarray  # (d_head,)


@dataclass(frozen=True, eq=False)
class HeadExplanation:
    """An /attention/explain answer: one head's attention at one query, step by step, as float64
    arrays: `q` [d_head], `keys` / `values` [keys, d_head], `scores` = keys @ q, `scaled` = scores
    * scale, `mask` (True = may attend), `masked` (-inf where masked), `softmax`, the model's own
    `pattern_row` beside it, and `z` = softmax @ values. `recompute()` does it again here.
    Asked with key=, `score_parts` (ScoreParts) says why the head attends to that key."""

    model: str
    family: str
    group: str
    layer: int
    head: int
    query: int
    query_token: Token
    key_tokens: list[Token]
    d_head: int
    scale: float
    kv_head: int
    positions: str
    formula: str
    q: np.ndarray
    keys: np.ndarray
    values: np.ndarray
    scores: np.ndarray
    scaled: np.ndarray
    mask: np.ndarray
    masked: np.ndarray
    softmax: np.ndarray
    pattern_row: np.ndarray
    z: np.ndarray
    tokens: list[Token]
    target_tokens: list[Token] | None = None
    generated: bool | None = None
    ablate: list[Ablation] | None = None
    score_parts: ScoreParts | None = None  # asked with key=: why the head attends to that key

    @classmethod
    def from_json(cls, body: dict) -> HeadExplanation:
        d_head = int(body["d_head"])
        vectors = lambda rows: np.array(rows, dtype=np.float64).reshape(len(rows), d_head)
        masked = np.array([-np.inf if v is None else float(v) for v in body["masked"]], dtype=np.float64)
        return cls(body["model"], body["family"], body["group"], int(body["layer"]), int(body["head"]),
                   int(body["query"]), Token.from_json(body["query_token"]), _tokens(body["key_tokens"]), d_head,
                   float(body["scale"]), int(body["kv_head"]), body["positions"], body["formula"],
                   np.array(body["q"], dtype=np.float64), vectors(body["keys"]), vectors(body["values"]),
                   np.array(body["scores"], dtype=np.float64), np.array(body["scaled"], dtype=np.float64),
                   np.array(body["mask"], dtype=bool), masked, np.array(body["softmax"], dtype=np.float64),
                   np.array(body["pattern_row"], dtype=np.float64), np.array(body["z"], dtype=np.float64),
                   _tokens(body["tokens"]),
                   _tokens(body["target_tokens"]) if body.get("target_tokens") is not None else None,
                   body.get("generated"), _ablations(body),
                   None if body.get("score_parts") is None else ScoreParts.from_json(body["score_parts"]))

    def recompute(self) -> Recomputed:
        """softmax(q . k * scale, masked) and its weighted sum of the values, from q, keys and
        values alone (float64): compare `.softmax` with `pattern_row`, `.z` with `z`."""
        logits = np.where(self.mask, self.keys @ self.q * self.scale, -np.inf)
        weights = np.exp(logits - logits.max())
        weights /= weights.sum()
        return Recomputed(weights, weights @ self.values)

    def __repr__(self) -> str:
        return (f"HeadExplanation(model={self.model!r}, group={self.group!r}, layer={self.layer}, head={self.head}, "
                f"query={self.query} {self.query_token.text!r}, keys={len(self.key_tokens)}, d_head={self.d_head})")


@dataclass(frozen=True)
class ScorePair:
    """One pair of parts: what wrote the query's stream (`query_part`) against what wrote the key's."""

    query_part: str
    key_part: str
    value: float

    @classmethod
    def from_json(cls, d: dict) -> ScorePair:
        return cls(d["query_part"], d["key_part"], float(d["value"]))


@dataclass(frozen=True, eq=False)
class ScoreParts:
    """Why a head attends from its query to `key` (/attention/explain with key=): its scaled score
    split into pairs of parts of the two residual streams (`parts`: embedding, positions, L{l}H{h},
    L{l} MLP, biases; an encoder-decoder's by group, "cross L0H1"). `key_parts` the key side's
    (a cross head's: the encoder's). `top_pairs` the largest first; `query_totals` [parts] /
    `key_totals` [key_parts] each part against the whole other side; `rest` = score minus the
    listed pairs. `softcap` (Gemma 2): the scores' soft-cap, no sum: `score` is before it, `capped_score`
    after."""

    key: int
    score: float
    probability: float
    parts: list[str]
    top_pairs: list[ScorePair]
    query_totals: np.ndarray
    key_totals: np.ndarray
    rest: float
    key_parts: list[str] | None = None
    softcap: float | None = None
    capped_score: float | None = None

    @classmethod
    def from_json(cls, d: dict) -> ScoreParts:
        return cls(int(d["key"]), float(d["score"]), float(d["probability"]), list(d["parts"]),
                   [ScorePair.from_json(p) for p in d["top_pairs"]], np.array(d["query_totals"], dtype=np.float64),
                   np.array(d["key_totals"], dtype=np.float64), float(d["rest"]), list(d.get("key_parts", d["parts"])),
                   d.get("softcap"), d.get("capped_score"))

    def __repr__(self) -> str:
        top = self.top_pairs[0] if self.top_pairs else None
        first = f", top {top.query_part} x {top.key_part} {top.value:+.3f}" if top else ""
        return f"ScoreParts(key={self.key}, score={self.score:.3f}, probability={self.probability:.3f}{first})"


# --- /patch, /logit-attribution --------------------------------------------------------------------
def _grid(values: list) -> np.ndarray:
    """Nested lists of floats (None: no value) as a float64 array, nan for None."""
    return np.array(values, dtype=np.float64)  # numpy reads None as nan


def _top(grid: np.ndarray, k: int) -> list[tuple[tuple[int, ...], float]]:
    flat = np.where(np.isnan(grid), -np.inf, grid).ravel()
    order = np.argsort(-flat, kind="stable")[:k]
    return [(tuple(int(i) for i in np.unravel_index(j, grid.shape)), float(grid.ravel()[j])) for j in order]


def _sender(sender: dict | None, grouped: bool) -> tuple | None:
    """A /patch answer's sender: (layer, head), an encoder-decoder's (group, layer, head)."""
    if sender is None:
        return None
    head = (int(sender["layer"]), int(sender["head"]))
    return (sender["group"], *head) if grouped else head


def _grids(values: Any) -> Any:
    """A /patch answer's values as float64 arrays, dicts of them kept (nested by group: an encoder-decoder's)."""
    return {k: _grids(v) for k, v in values.items()} if isinstance(values, dict) else _grid(values)


def _leaves(values: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], np.ndarray]]:
    """(path, array) of each grid in nested dicts of them, in order."""
    if not isinstance(values, dict):
        return [(path, values)]
    return [leaf for k, v in values.items() for leaf in _leaves(v, (*path, k))]


def _top_of(values: Any, k: int, part: str | None, by_group: bool) -> list[tuple[tuple, float]]:
    """The k largest cells of `values`: of its `part` (a dotted path for nested dicts, "decoder.cross"); by
    default of its first grid, or, by group (an encoder-decoder's answer), of every grid ranked together,
    each index led by its path (("cross", layer, head), v)."""
    if part is not None:
        for name in part.split("."):
            values = values[name]
        return _top(values, k)
    if not by_group or not isinstance(values, dict):
        return _top(_leaves(values)[0][1], k)
    cells = [((*path, *index), v) for path, grid in _leaves(values) for index, v in _top(grid, grid.size)]
    return sorted(cells, key=lambda cell: -cell[1] if not math.isnan(cell[1]) else math.inf)[:k]


@dataclass(frozen=True, eq=False)
class PatchAnswer:
    """A /patch answer: each cell of `component` patched from the clean run into the corrupted one, its
    patched metric logit(answer) - logit(foil) at `position`, raw. `values` a float64 array (heads
    [L, H], heads_by_position [L, T, H], residual [L, T]) or a dict of them (layers: "attention",
    "mlp" [L, T]; paths: "q", "k", "v" [L, H], nan at layers up to the sender's). An encoder-decoder's
    (`target_tokens` given, `position` on the target) come by group: {"encoder", "decoder", "cross"} for
    heads, {"encoder", "decoder"} for residual, {"encoder": {"attention", "mlp"}, "decoder": {"attention",
    "cross", "mlp"}} for layers, {"encoder", "decoder", "cross": {"q", "k", "v"}} for paths (nan where
    the sender has no direct path), its `sender` (group, layer, head). `normalized`: 0 = the corrupted
    run, 1 = the clean run; `top(k)` the cells that restore the most."""

    model: str
    component: str
    method: str
    position: int
    clean_metric: float
    corrupted_metric: float
    values: Any  # np.ndarray, or dict[str, np.ndarray] for layers and paths (nested: an encoder-decoder's)
    clean_tokens: list[Token]
    corrupted_tokens: list[Token]
    differing: list[int]
    answer: Token
    foil: Token
    sender: tuple | None = None  # paths: (layer, head); an encoder-decoder's (group, layer, head)
    target_tokens: list[Token] | None = None  # an encoder-decoder's target, the start token first

    @classmethod
    def from_json(cls, body: dict) -> PatchAnswer:
        sender = body.get("sender")
        target = body.get("target_tokens")
        return cls(body["model"], body["component"], body["method"], int(body["position"]),
                   float(body["clean_metric"]), float(body["corrupted_metric"]), _grids(body["values"]),
                   _tokens(body["clean_tokens"]), _tokens(body["corrupted_tokens"]), [int(p) for p in body["differing"]],
                   Token.from_json(body["answer"]), Token.from_json(body["foil"]),
                   _sender(sender, target is not None), None if target is None else _tokens(target))

    @property
    def normalized(self) -> Any:
        """values as (v - corrupted_metric) / (clean_metric - corrupted_metric), same shapes."""
        span = self.clean_metric - self.corrupted_metric

        def scale(v: Any) -> Any:
            if isinstance(v, dict):
                return {k: scale(x) for k, x in v.items()}
            return (v - self.corrupted_metric) / span if span else v * np.nan
        return scale(self.values)

    def top(self, k: int = 5, part: str | None = None) -> list[tuple[tuple, float]]:
        """The k cells whose patch raises the metric most ((index, value), largest first): heads
        ((layer, head), v); by position ((layer, position[, head]), v). `part` picks layers' "attention"
        or "mlp", paths' "q", "k" or "v" (default the first); an encoder-decoder's group ("cross",
        "decoder.mlp"; default every group ranked together, each index led by its group:
        (("cross", layer, head), v))."""
        return _top_of(self.values, k, part, self.target_tokens is not None)

    def __repr__(self) -> str:
        return (f"PatchAnswer(model={self.model!r}, component={self.component!r}, method={self.method!r}, "
                f"clean={self.clean_metric:.3f}, corrupted={self.corrupted_metric:.3f}, T={len(self.clean_tokens)})")


@dataclass(frozen=True, eq=False)
class LogitAttributionAnswer:
    """A /logit-attribution answer: each part's direct write into logit(answer) - logit(foil) at
    `position`: `heads` [L, H] (an encoder-decoder's {"decoder", "cross": [L, H]}, `target_tokens`
    given and `position` on the target), `mlps` [L], `embedding`, `other` (`other_parts` by name); they
    sum to `logit_difference`. `top(k)` the heads that write the most. `softcap` (Gemma 2): the logits'
    soft-cap, no sum: the logits and their difference are before it, `capped_logit_difference` after."""

    model: str
    tokens: list[Token]
    position: int
    answer: Token
    foil: Token
    logit_difference: float
    heads: Any  # np.ndarray, or dict[str, np.ndarray] (an encoder-decoder's)
    mlps: np.ndarray
    embedding: float
    other: float
    answer_logit: float | None = None
    foil_logit: float | None = None
    other_parts: dict[str, float] | None = None
    target_tokens: list[Token] | None = None
    softcap: float | None = None
    capped_logit_difference: float | None = None

    @classmethod
    def from_json(cls, body: dict) -> LogitAttributionAnswer:
        parts = body.get("other_parts")
        target = body.get("target_tokens")
        return cls(body["model"], _tokens(body["tokens"]), int(body["position"]), Token.from_json(body["answer"]),
                   Token.from_json(body["foil"]), float(body["logit_difference"]), _grids(body["heads"]),
                   np.array(body["mlps"], dtype=np.float64), float(body["embedding"]), float(body["other"]),
                   body.get("answer_logit"), body.get("foil_logit"),
                   None if parts is None else {k: float(v) for k, v in parts.items()},
                   None if target is None else _tokens(target), body.get("softcap"), body.get("capped_logit_difference"))

    @property
    def total(self) -> float:
        """The parts' sum: logit_difference within float rounding."""
        heads = sum(float(grid.sum()) for _, grid in _leaves(self.heads))
        return float(heads + self.mlps.sum() + self.embedding + self.other)

    def top(self, k: int = 5, part: str | None = None) -> list[tuple[tuple, float]]:
        """The k heads that write the most into the difference (((layer, head), value), largest first); an
        encoder-decoder's of `part` ("decoder" or "cross"), by default both ranked together
        ((("cross", layer, head), value))."""
        return _top_of(self.heads, k, part, isinstance(self.heads, dict))

    def __repr__(self) -> str:
        return (f"LogitAttributionAnswer(model={self.model!r}, position={self.position}, answer={self.answer.text!r}, "
                f"foil={self.foil.text!r}, logit_difference={self.logit_difference:.3f})")
