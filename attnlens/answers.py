"""Typed answers of the attnlens API, built from its JSON (numpy for the maps, nothing heavier).

Attention maps are always [layer][head][query][key]: `Attention.maps` is a float32 array of
that shape holding the layers and heads the answer was asked for (`layers`, `heads` say which),
decoded from whichever format and packing the server sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from .codec import decode


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


# --- /attention ----------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class AttentionGroup:
    """One group of maps: `maps` [layers][heads][rows][cols]; rows attend to columns.

    Named as the model's family declares them (the answer's `groups`, GET /models' family_info):
    a decoder's and an encoder's one group is "self"; an encoder-decoder has three: "encoder"
    (source over source), "decoder" (target over target, causal) and "cross" (target rows over
    source columns). `queries` / `keys` are the axes the rows and columns run over."""

    name: str
    maps: np.ndarray  # (L', H', rows, cols) float32
    rows: list[Token]
    cols: list[Token]
    causal: bool  # zero above the diagonal
    queries: str = "tokens"  # the rows' axis: tokens | source | target
    keys: str = "tokens"  # the columns' axis


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
            target_tokens=_tokens(translation["target_tokens"]) if "target_tokens" in translation else None,
            generated=bool(translation["generated"]) if "generated" in translation else None)

    @classmethod
    def from_arrays(cls, *, model: str, family: str, direction: str, tokens: list[Token], n_layers: int,
                    n_heads: int, layers: list[int], heads: list[int], format: str, specs: list[GroupSpec],
                    maps: dict[str, np.ndarray], text: str | None = None, target_tokens: list[Token] | None = None,
                    generated: bool | None = None) -> Attention:
        """From maps in hand, group by group (`specs`, the primary first, over `tokens`; a group
        over the target axis has `target_tokens` as its rows or columns)."""
        along = {"tokens": tokens, "source": tokens, "target": target_tokens}
        groups = {s.name: AttentionGroup(s.name, np.asarray(maps[s.name], dtype=np.float32), along[s.queries],
                                         along[s.keys], s.causal, s.queries, s.keys) for s in specs}
        return cls(model, family, direction, tokens, n_layers, n_heads, list(layers), list(heads), format,
                   groups[specs[0].name].maps, groups, text, target_tokens, generated)

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

    @classmethod
    def from_json(cls, body: dict) -> Generation:
        rows = body.get("attention") or [None] * len(body["tokens"])
        cross = body.get("cross_attention") or [None] * len(body["tokens"])
        return cls(body["id"], body["model"], body["text"], _tokens(body["prompt_tokens"]),
                   [GeneratedToken.from_json(t, a, c) for t, a, c in zip(body["tokens"], rows, cross)],
                   body["finish_reason"], Usage(**body["usage"]), Timings(**body["timings"]))

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

    @classmethod
    def from_json(cls, body: dict) -> StreamDone:
        return cls(body["id"], body["finish_reason"], _tokens(body["prompt_tokens"]), body["text"],
                   body.get("delta", ""), Usage(**body["usage"]), Timings(**body["timings"]))


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
