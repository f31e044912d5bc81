"""The model-side operations, run by name with typed arguments: what the service asks of a loaded
model besides generating (the engine's model-call line, or an encoder's worker threads).

Each operation is one frozen dataclass of plain arguments (ids, indices, options) that names its
operation; `run_operation(model, call)` looks the name up in OPERATIONS and runs it on the model.
Only such data crosses the pipe to an engine process (it pickles by value), never a closure, and
what comes back is plain data too (dataclasses, numpy, lists, dicts).

    call              operation        result
    AttentionCall     attention        AnalysisMaps (attention_maps.py)
    HeadScoresCall    head_scores      HeadScoreResult (head_atlas_scores.py)
    LogitsCall        logits           LogitsReport (explain.py: a TypedDict of lists and floats)
    LensCall          lens             LensReport (its "error" names a position past a generated
                                       target's end)
    ExplainHeadCall   explain_head     HeadStep ("error" likewise for the query)
    FillMaskCall      fill_mask        MaskScores (encoder_outputs.py)
    ClassifyCall      classify         list[float], every label's probability in the config's order
    EmbedCall         embed            (N, C) float32 numpy unit vectors
    WarmUpCall        warm_up          None (one attention analysis, and an encoder's heads' forward)
    PatchCall         patch            PatchResult (patching.py: exact, or attribution_patching.py;
                                       an encoder-decoder's: encoder_decoder_patching.py)
    LogitAttributionCall  logit_attribution  LogitAttribution (logit_attribution.py; an encoder-
                                       decoder's: encoder_decoder_attribution.py)
    ScoreDecompositionCall  score_decomposition  ScoreDecomposition (score_decomposition.py; an encoder-
                                       decoder's: encoder_decoder_scores.py, or only "error" for a
                                       query past its generated target's end)

The causal calls (patch, logit_attribution, score_decomposition) have `check(config)`: the
ValueError, naming the field, that the operation itself raises for arguments the model cannot take,
raised before the call is queued.

`report`, given to run_operation, is called at a long operation's progress points: the engine's
heartbeat, and where a call whose caller went away stops (app/engine/progress.py's report()).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Generic, TypeVar

import numpy as np

from attnlens.model.analysis import explain
from attnlens.model.analysis.attention_maps import AnalysisMaps, MapRequest, analyse_attention
from attnlens.model.analysis.attribution_patching import attribution_patch
from attnlens.model.analysis.encoder_decoder_attribution import (
    check_encoder_decoder_attribution,
    encoder_decoder_logit_attribution,
)
from attnlens.model.analysis.encoder_decoder_patching import (
    attribution_patch_encoder_decoder,
    check_encoder_decoder_patch,
    patch_encoder_decoder,
)
from attnlens.model.analysis.encoder_decoder_scores import (
    Unreached,
    check_encoder_decoder_score,
    decompose_encoder_decoder_score,
)
from attnlens.model.analysis.encoder_outputs import (
    MAX_BATCH_TOKENS,
    MaskScores,
    class_probabilities,
    embed_rows,
    encoder_warm_up,
    mask_scores,
)
from attnlens.model.analysis.head_atlas_scores import ClarkProbe, HeadScoreResult, score_heads
from attnlens.model.analysis.logit_attribution import LogitAttribution, check_attribution, logit_attribution
from attnlens.model.analysis.patching import PatchResult, check_patch, patch
from attnlens.model.analysis.score_decomposition import ScoreDecomposition, check_score, decompose_score
from attnlens.model.hooks import ZEdit

Report = Callable[[], None]


def _no_report() -> None:
    pass


R = TypeVar("R", covariant=True)


class Operation(Generic[R]):
    """A model operation whose result is an R: run_operation(model, call) gives one, and so does
    `await engine.call(call)`."""

    operation: ClassVar[str]


@dataclass(frozen=True)
class AttentionCall(Operation[AnalysisMaps]):
    """The asked layers' and heads' maps of every group (MapRequest: whole, window, pool, top-k)."""

    operation: ClassVar[str] = "attention"
    ids: list[int]
    layers: list[int]
    heads: list[int]
    target_ids: list[int] | None = None
    ablate: tuple[ZEdit, ...] = ()
    want: MapRequest = MapRequest()
    fmt: str = "json"
    keep_bytes: int = 0


@dataclass(frozen=True)
class HeadScoresCall(Operation[HeadScoreResult]):
    """Every head's scores of every group (with `clark`, an encoder's Clark et al. scores too)."""

    operation: ClassVar[str] = "head_scores"
    ids: list[int]
    target_ids: list[int] | None = None
    clark: ClarkProbe | None = None


@dataclass(frozen=True)
class LogitsCall(Operation[explain.LogitsReport]):
    """Per position (or the last only) the top-k predictions, with and without ablated heads."""

    operation: ClassVar[str] = "logits"
    ids: list[int]
    target_ids: list[int] | None
    ablate: tuple[ZEdit, ...]
    top_k: int
    last_only: bool


@dataclass(frozen=True)
class LensCall(Operation[explain.LensReport]):
    """The logit lens: every block's residual stream through the final norm and the head."""

    operation: ClassVar[str] = "lens"
    ids: list[int]
    target_ids: list[int] | None
    ablate: tuple[ZEdit, ...]
    top_k: int
    positions: list[int] | None = None
    rank: bool = False


@dataclass(frozen=True)
class ExplainHeadCall(Operation[explain.HeadStep]):
    """One head's attention at one query, step by step."""

    operation: ClassVar[str] = "explain_head"
    ids: list[int]
    target_ids: list[int] | None
    group_name: str
    layer: int
    head: int
    query: int
    ablate: tuple[ZEdit, ...] = ()


@dataclass(frozen=True)
class FillMaskCall(Operation[MaskScores]):
    """The masked-LM head's top_k at `positions` of framed `ids`, over the tokenizer's `vocab_size`
    tokens, never one of `never`."""

    operation: ClassVar[str] = "fill_mask"
    ids: list[int]
    positions: list[int]
    vocab_size: int
    never: list[int]
    top_k: int


@dataclass(frozen=True)
class ClassifyCall(Operation[list[float]]):
    """Every label's probability of framed `ids`."""

    operation: ClassVar[str] = "classify"
    ids: list[int]


@dataclass(frozen=True)
class EmbedCall(Operation[np.ndarray]):
    """The unit sentence embedding of each framed row, in right-padded batches."""

    operation: ClassVar[str] = "embed"
    rows: list[list[int]]
    pad_id: int
    max_tokens: int = MAX_BATCH_TOKENS


@dataclass(frozen=True)
class WarmUpCall(Operation[None]):
    """Start-up: one attention analysis of `ids` (layer 0, head 0) and, given `encoder_ids`
    ([CLS] [MASK] [SEP]), a forward through the encoder's heads."""

    operation: ClassVar[str] = "warm_up"
    ids: list[int]
    encoder_ids: list[int] | None = None


@dataclass(frozen=True)
class PatchCall(Operation[PatchResult]):
    """Activation patching of a decoder: each cell of `component` patched from the clean run into the
    corrupted one, the metric logit(answer) - logit(foil) at `position` (default the last); `method`
    "exact" or "attribution" (first-order estimates); `sender` (layer, head) for component "paths".
    An encoder-decoder's clean and corrupted ids are sources, read with one target (`target_ids`,
    after the start token; None: none) at whose `position` the metric is; its sender is a head of
    `sender_group` (encoder, decoder or cross)."""

    operation: ClassVar[str] = "patch"
    clean_ids: list[int]
    corrupted_ids: list[int]
    answer_id: int
    foil_id: int
    position: int | None = None
    component: str = "heads"  # heads | heads_by_position | residual | layers | paths
    method: str = "exact"  # exact | attribution
    sender: tuple[int, int] | None = None
    target_ids: list[int] | None = None
    sender_group: str | None = None  # an encoder-decoder's paths: the sender's group

    def check(self, config) -> None:
        if config.family == "encoder-decoder":
            check_encoder_decoder_patch(config, self.clean_ids, self.corrupted_ids, self.target_ids, self.answer_id,
                                        self.foil_id, self.position, self.component, self.method, self.sender,
                                        self.sender_group)
            return
        check_target(config, self.target_ids)
        if self.sender_group is not None:
            raise ValueError(f"sender group {self.sender_group!r}: a decoder's heads are one group; give the sender's "
                             "layer and head only")
        check_patch(config, self.clean_ids, self.corrupted_ids, self.answer_id, self.foil_id, self.position,
                    self.component, self.method, self.sender)


@dataclass(frozen=True)
class LogitAttributionCall(Operation[LogitAttribution]):
    """Each head's, MLP's, the embedding's and the rest's direct effect on logit(answer) - logit(foil) at
    `position` (defaults: the last position, its top two predictions). An encoder-decoder's ids are the
    source, `position` is on its target (`target_ids`, after the start token)."""

    operation: ClassVar[str] = "logit_attribution"
    ids: list[int]
    answer_id: int | None = None
    foil_id: int | None = None
    position: int | None = None
    target_ids: list[int] | None = None

    def check(self, config) -> None:
        if config.family == "encoder-decoder":
            check_encoder_decoder_attribution(config, self.ids, self.target_ids, self.answer_id, self.foil_id,
                                              self.position)
            return
        check_target(config, self.target_ids)
        check_attribution(config, self.ids, self.answer_id, self.foil_id, self.position)


@dataclass(frozen=True)
class ScoreDecompositionCall(Operation[ScoreDecomposition | Unreached]):
    """Why head `head` of block `layer` attends from `query` to `key`: its score split into pairs of
    parts of the two residual streams, the `top_k` largest listed. An encoder-decoder's head is in
    `group` (encoder, decoder, cross), its ids the source, read with `target_ids` (None: the greedy
    translation)."""

    operation: ClassVar[str] = "score_decomposition"
    ids: list[int]
    layer: int
    head: int
    query: int
    key: int
    top_k: int = 20
    target_ids: list[int] | None = None
    group: str | None = None

    def check(self, config) -> None:
        if config.family == "encoder-decoder":
            check_encoder_decoder_score(config, self.ids, self.target_ids, self.group, self.layer, self.head,
                                        self.query, self.key)
            return
        check_target(config, self.target_ids)
        if self.group not in (None, "self"):
            raise ValueError(f"group {self.group!r}: a decoder's heads are one group, self")
        check_score(config, self.ids, self.layer, self.head, self.query, self.key)


def check_target(config, target_ids: list[int] | None) -> None:
    if target_ids is not None:
        raise ValueError(f"target_ids is an encoder-decoder's target; this model is an {config.family}")


def _attention(model, call: AttentionCall, report: Report) -> AnalysisMaps:
    return analyse_attention(model, call.ids, call.layers, call.heads, call.target_ids, call.ablate, call.want,
                             call.fmt, call.keep_bytes, report=report)


def _head_scores(model, call: HeadScoresCall, report: Report) -> HeadScoreResult:
    return score_heads(model, call.ids, call.target_ids, call.clark)


def _logits(model, call: LogitsCall, report: Report) -> explain.LogitsReport:
    return explain.logits_report(model, call.ids, call.target_ids, call.ablate, call.top_k, call.last_only,
                                 progress=report)


def _lens(model, call: LensCall, report: Report) -> explain.LensReport:
    return explain.lens_report(model, call.ids, call.target_ids, call.ablate, call.top_k, call.positions, call.rank,
                               progress=report)


def _explain_head(model, call: ExplainHeadCall, report: Report) -> explain.HeadStep:
    return explain.explain_head(model, call.ids, call.target_ids, call.group_name, call.layer, call.head,
                                call.query, call.ablate, progress=report)


def _fill_mask(model, call: FillMaskCall, report: Report) -> MaskScores:
    return mask_scores(model, call.ids, call.positions, call.vocab_size, call.never, call.top_k)


def _classify(model, call: ClassifyCall, report: Report) -> list[float]:
    return class_probabilities(model, call.ids)


def _embed(model, call: EmbedCall, report: Report) -> np.ndarray:
    return embed_rows(model, call.rows, call.pad_id, call.max_tokens, report=report)


def _warm_up(model, call: WarmUpCall, report: Report) -> None:
    analyse_attention(model, call.ids, [0], [0], report=report)
    if call.encoder_ids is not None:
        encoder_warm_up(model, call.encoder_ids)


def _patch(model, call: PatchCall, report: Report) -> PatchResult:
    call.check(model.config)
    if model.config.family == "encoder-decoder":
        args = (model, call.clean_ids, call.corrupted_ids, call.answer_id, call.foil_id, call.position,
                call.component, call.target_ids)
        if call.method == "attribution":
            return attribution_patch_encoder_decoder(*args, report=report)
        sender = None if call.sender is None or call.sender_group is None else (call.sender_group, *call.sender)
        return patch_encoder_decoder(*args, report=report, sender=sender)
    if call.method == "attribution":
        return attribution_patch(model, call.clean_ids, call.corrupted_ids, call.answer_id, call.foil_id,
                                 call.position, call.component, report=report)
    return patch(model, call.clean_ids, call.corrupted_ids, call.answer_id, call.foil_id, call.position,
                 call.component, call.sender, report=report)


def _logit_attribution(model, call: LogitAttributionCall, report: Report) -> LogitAttribution:
    if model.config.family == "encoder-decoder":
        call.check(model.config)
        return encoder_decoder_logit_attribution(model, call.ids, call.target_ids, call.answer_id, call.foil_id,
                                                 call.position, report=report)
    return logit_attribution(model, call.ids, call.answer_id, call.foil_id, call.position, report=report)


def _score_decomposition(model, call: ScoreDecompositionCall, report: Report) -> ScoreDecomposition | Unreached:
    call.check(model.config)
    if model.config.family == "encoder-decoder":
        assert call.group is not None  # the check asks for one
        return decompose_encoder_decoder_score(model, call.ids, call.target_ids, call.group, call.layer, call.head,
                                               call.query, call.key, call.top_k, report=report)
    return decompose_score(model, call.ids, call.layer, call.head, call.query, call.key, call.top_k, report=report)


# name -> what runs it: fn(model, call, report)
OPERATIONS: dict[str, Callable[[Any, Any, Report], Any]] = {
    AttentionCall.operation: _attention,
    HeadScoresCall.operation: _head_scores,
    LogitsCall.operation: _logits,
    LensCall.operation: _lens,
    ExplainHeadCall.operation: _explain_head,
    FillMaskCall.operation: _fill_mask,
    ClassifyCall.operation: _classify,
    EmbedCall.operation: _embed,
    WarmUpCall.operation: _warm_up,
    PatchCall.operation: _patch,
    LogitAttributionCall.operation: _logit_attribution,
    ScoreDecompositionCall.operation: _score_decomposition,
}

ModelOperation = (AttentionCall | HeadScoresCall | LogitsCall | LensCall | ExplainHeadCall | FillMaskCall
                  | ClassifyCall | EmbedCall | WarmUpCall | PatchCall | LogitAttributionCall | ScoreDecompositionCall)


def run_operation(model, call: Operation[R], report: Report | None = None) -> R:
    """Run the operation `call` names on `model` (the nn.Module, on whatever device holds it)."""
    try:
        run = OPERATIONS[call.operation]
    except (AttributeError, KeyError):
        raise ValueError(f"not a model operation: {call!r}") from None
    return run(model, call, report or _no_report)
