"""The family contract: what a model family declares, and what its module offers.

A family is data. Each family module (decoder.py, encoder.py, encoder_decoder.py) declares one
`Family` and its nn.Module carries it as the class attribute `family`; families/__init__.py lists
them. The service, the engine and the page read the declaration (its tasks, its attention groups
and their axes, how it generates, what its forward returns); none of them tests a family's name.

    Family            name, tasks, attention groups, generation (or None), text framing, output type
    AttentionGroup    one kind of map: its query axis, its key axis, causal or not
    GenerationSpec    how the batched engine serves it: what a prompt is, which groups a step streams
    TaskSpec          a task and the checkpoint feature it needs ("labels", "chat_template")

What a family's module offers, as Protocols (vLLM's model interfaces, interfaces_base.py):

    AnalysableModel   analyse(ids, target_ids) -> AttentionAnalysis: every group's maps in one call;
                      sequence(ids, target_ids) -> the ids by axis; run_sequence(tokens): one forward of
                      them (model/analysis/attention_maps.py reduces its maps block by block)
    GenerativeModel   new_kv_cache(rows), kv_cache_row_bytes(); forward(ids, kv_cache=, rows=, ...) -> output;
                      step_attention(output, cache, rows, queries) -> each row's step maps by group
    FixedShapeDecoder decode_fixed(ids, cache, lengths): a decode step of fixed shapes (CUDA graphs)

Axes: "tokens" (one sequence, read by itself), "source" (what an encoder reads), "target" (what
a decoder writes while reading a source). A map is always [layer][head][query][key].
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Protocol, runtime_checkable

import torch

Axis = Literal["tokens", "source", "target"]
AXES: tuple[str, ...] = ("tokens", "source", "target")


@dataclass(frozen=True)
class AttentionGroup:
    """One kind of attention map a family computes: rows over `queries`, columns over `keys`."""

    name: str  # its key in answers and declarations, e.g. "self", "encoder", "decoder", "cross"
    queries: Axis
    keys: Axis
    causal: bool  # zero above the diagonal (queries and keys are then the same sequence)
    description: str
    # the hook name (model/hooks.py) of layer {layer}'s attention module holding this group's heads
    hook: str = "blocks.{layer}.attn"

    @property
    def is_cross(self) -> bool:
        """Queries read another sequence than their own (an encoder-decoder's cross-attention)."""
        return self.queries != self.keys


@dataclass(frozen=True)
class GenerationSpec:
    """How the batched generation engine serves a family.

    prompt "prefix": the generation continues the prompt in one context (prompt + new tokens fit
    the context length). "source": the prompt is a source an encoder reads once; the output has
    a context of its own and its first query is the decoder's start token.
    """

    prompt: Literal["prefix", "source"]
    step_groups: tuple[str, ...]  # the groups a generated token's attention rows come from

    @property
    def scores_prompt(self) -> bool:
        """Whether a prompt token has a log-probability (a prefix is predicted; a source is read)."""
        return self.prompt == "prefix"


@dataclass(frozen=True)
class LensSpec:
    """How /logits and /lens read a family (model/analysis/explain.py): the residual stream whose positions
    are scored and what a position's logits predict."""

    stream: Axis  # the axis the scored positions run over: "tokens" or "target"
    stack: str  # the hook prefix of that stream's blocks (model/hooks.py): "blocks" | "decoder.blocks"
    predicts: Literal["next", "same"]  # an LM head predicts the next token; an MLM head the one at the position
    head: str  # for people: which head turns the stream into logits


@dataclass(frozen=True)
class TaskSpec:
    name: str  # generate, completions, chat, attention, fill-mask, classify, embeddings
    needs: str | None = None  # a feature the checkpoint must have: "labels", "chat_template"


@dataclass(frozen=True)
class TrainingSpec:
    """How `attnlens train` trains the family (model/training). `objective` names the class that
    makes its batches and losses, as "module:Class" under attnlens.model.training; it is built as
    Objective(run, tokenizer, device, autocast, texts), where `texts` is the corpus' (train, val)
    works when `data` is "corpus" and None when the objective makes its own data ("own": the
    translator's generated pairs). `tokenizer` is the one trained when a run names none: "corpus"
    (byte-level BPE over the works), "corpus_specials" (the same with [PAD] [CLS] [SEP] [MASK]) or
    "translation" (model/training/train_translation.py's)."""

    objective: str
    data: Literal["corpus", "own"] = "corpus"
    tokenizer: Literal["corpus", "corpus_specials", "translation"] = "corpus"

    def objective_class(self) -> type:
        module, _, name = self.objective.partition(":")
        return getattr(importlib.import_module(f"attnlens.model.training.{module}"), name)


@dataclass(frozen=True)
class Family:
    """A family's declaration (see the module docstring)."""

    name: str  # the config's `family`
    description: str
    tasks: tuple[TaskSpec, ...]
    groups: tuple[AttentionGroup, ...]  # the first is the primary one: what one sequence's analysis shows
    attention_kind: str  # a one-word summary for people and the API: causal | bidirectional | encoder-decoder
    output: type  # what the module's forward returns
    generation: GenerationSpec | None = None  # None: the family does not generate
    # how a text becomes the ids analysed: "plain" (its tokens), "cls_sep" ([CLS] tokens [SEP], as BERT)
    framing: Literal["plain", "cls_sep"] = "plain"
    features: tuple[str, ...] = field(default=())  # what its checkpoints can have: labels, chat_template
    # the optional parts its module builds when a config asks (ModelConfig.parts_used): rotary,
    # sliding_window, rmsnorm, grouped_query, parallel_residual, classifier
    builds: tuple[str, ...] = field(default=())
    training: TrainingSpec | None = None  # None: `attnlens train` cannot train it (imported only)
    lens: LensSpec | None = None  # None: no logits to read per position (model/analysis/explain.py)

    # what follows from the declaration, set once when it is made (every request reads them; nothing
    # computes them again): the primary group, the groups by name, the axes they use, ...
    primary: AttentionGroup = field(init=False, repr=False, compare=False)  # the first group
    groups_by_name: dict[str, AttentionGroup] = field(init=False, repr=False, compare=False)
    axes: tuple[str, ...] = field(init=False, repr=False, compare=False)  # every axis its groups use, in AXES order
    takes_target: bool = field(init=False, repr=False, compare=False)  # an analysis can be given a target
    has_causal_group: bool = field(init=False, repr=False, compare=False)
    # the group a head ablation names by default (model/hooks.py): the first a generation steps with,
    # else the primary one
    ablation_group: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"family {self.name!r}: attention group names repeat: {names}")
        if self.generation is not None:
            unknown = [g for g in self.generation.step_groups if g not in names]
            if unknown:
                raise ValueError(f"family {self.name!r}: step groups {unknown} are not among its groups {names}")
        used = {a for g in self.groups for a in (g.queries, g.keys)}
        facts = {
            "primary": self.groups[0],
            "groups_by_name": {g.name: g for g in self.groups},
            "axes": tuple(a for a in AXES if a in used),
            "takes_target": "target" in used,  # the decoder side of an encoder-decoder
            "has_causal_group": any(g.causal for g in self.groups),
            "ablation_group": self.generation.step_groups[0] if self.generation is not None else self.groups[0].name,
        }
        for name, value in facts.items():  # a frozen dataclass sets its own fields through object
            object.__setattr__(self, name, value)

    def group(self, name: str) -> AttentionGroup:
        """The group named `name` (a KeyError naming the family's when there is none)."""
        group = self.groups_by_name.get(name)
        if group is None:
            raise KeyError(f"family {self.name!r} has no attention group {name!r}")
        return group

    def task_names(self, features: set[str] | frozenset[str] = frozenset()) -> list[str]:
        """The tasks a checkpoint of this family answers, given the features it has."""
        return [t.name for t in self.tasks if t.needs is None or t.needs in features]

    def describe(self) -> dict:
        """The declaration as JSON-able data (GET /models): what the page reads."""
        return {
            "name": self.name,
            "description": self.description,
            "attention_kind": self.attention_kind,
            "framing": self.framing,
            "axes": list(self.axes),
            "groups": [{"name": g.name, "queries": g.queries, "keys": g.keys, "causal": g.causal,
                        "cross": g.is_cross, "description": g.description} for g in self.groups],
            "generation": None if self.generation is None else {
                "prompt": self.generation.prompt, "step_groups": list(self.generation.step_groups)},
            "lens": None if self.lens is None else {
                "stream": self.lens.stream, "predicts": self.lens.predicts, "head": self.lens.head},
            "ablation_group": self.ablation_group,
        }


@dataclass
class AttentionAnalysis:
    """Every attention group of one analysed input, as AnalysableModel.analyse returns it.

    tokens: the ids along each axis the family uses (an encoder-decoder's target starts with the
    decoder's start token: row t is the step that wrote target token t + 1).
    maps: group name -> (L, H, Q, K) probabilities, every layer and head.
    """

    tokens: dict[str, list[int]]
    maps: dict[str, torch.Tensor]
    generated_target: bool = False  # the target is the model's own greedy output


@runtime_checkable
class AnalysableModel(Protocol):
    family: ClassVar[Family]

    def analyse(self, ids: list[int], target_ids: list[int] | None = None) -> AttentionAnalysis: ...

    def sequence(self, ids: list[int], target_ids: list[int] | None = None) -> tuple[dict[str, list[int]], bool]:
        """The ids along each axis (a default target: the model's own output) and whether it made them."""
        ...

    def run_sequence(self, tokens: dict[str, list[int]]) -> None:
        """One forward of `tokens` (as `sequence` gives them), for the intermediates hooks keep
        (model/analysis/attention_maps.py makes every group's maps from its queries and keys)."""
        ...


@runtime_checkable
class GenerativeModel(Protocol):
    family: ClassVar[Family]

    def new_kv_cache(self, n_rows: int = 1): ...

    def kv_cache_row_bytes(self) -> int:
        """The bytes one row of new_kv_cache holds (computed, not allocated)."""
        ...

    def forward(self, ids: torch.Tensor, *, kv_cache=None, rows: slice | None = None, return_attention: bool = False,
                last_only: bool = False, valid: torch.Tensor | None = None): ...

    def step_attention(self, output, cache, rows: slice, queries: list[int]) -> list[dict[str, list[torch.Tensor]]]:
        """Per row of `rows`: group -> per layer (H, K) attention of that row's query position
        queries[b] over the keys the row has (never another row's, never padding)."""
        ...


@runtime_checkable
class InspectableModel(Protocol):
    """What model/analysis/explain.py (the logits, the lens, a head's computation) reads of a family."""

    family: ClassVar[Family]

    def sequence(self, ids: list[int], target_ids: list[int] | None = None) -> tuple[dict[str, list[int]], bool]:
        """The ids along each axis (a target starts with the decoder's start token; without one, the
        model's greedy output) and whether the target was generated."""
        ...

    def stream_logits(self, tokens: dict[str, list[int]]) -> torch.Tensor:
        """One forward of the sequence: (T, V) logits over the lens stream's positions (hooks apply)."""
        ...

    def unembed(self, x: torch.Tensor) -> torch.Tensor:
        """A residual stream (..., C) through the final norm and the head: (..., V)."""
        ...


@runtime_checkable
class FixedShapeDecoder(Protocol):
    def decode_fixed(self, ids: torch.Tensor, kv_cache, lengths: torch.Tensor, *,
                     return_attention: bool = False): ...


def family_of(model) -> Family:
    """The declaration a model module carries."""
    family = getattr(model, "family", None)
    if not isinstance(family, Family):
        raise TypeError(f"{type(model).__name__} declares no model family (a `family: Family` class attribute)")
    return family
