"""POST /logits, /lens and /attention/explain's serving side (app/api/explain_routes.py is the thin
router): one request -> one model call -> one answer.

Each route reads its sequence as /attention does (`read_sequence`), checks its ablations and
indices (400 naming the field), claims the answer's estimated bytes from the answer budget
(ATTNLENS_MAX_ANSWER_BYTES, as /attention), runs model/analysis/explain.py on the model's side
(a LogitsCall, LensCall or ExplainHeadCall through the model's runner: the engine's
model-call line, bounded by
ATTNLENS_MAX_ATTENTION_CONCURRENT, or the encoder's runner) and builds the answer on a worker
thread. Nothing here runs the model on the event loop.

/attention/explain's optional `key` adds a second call, ScoreDecompositionCall (a pre-norm
decoder's or an encoder-decoder's, any of its groups): why the head attends from the query to that
key (`score_parts`); an answer without `key` has no such field, as before.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from fastapi import Request
from pydantic import BaseModel

from attnlens.app.api.explain_schemas import (
    ExplainRequest,
    ExplainResponse,
    LensRequest,
    LensResponse,
    LogitsRequest,
    LogitsResponse,
)
from attnlens.app.registry.model_registry import ServedModel
from attnlens.app.server.api_errors import ApiError
from attnlens.app.server.state import AppState
from attnlens.app.serving.ablation_edits import resolve_ablate
from attnlens.app.serving.answer_budget import answer_with_claim
from attnlens.app.serving.prompts import read_sequence
from attnlens.model.analysis import explain
from attnlens.model.analysis.operations import ExplainHeadCall, LensCall, LogitsCall, ScoreDecompositionCall
from attnlens.model.analysis.score_decomposition import ScoreDecomposition
from attnlens.model.families.contract import LensSpec

FLOAT_BYTES = 24  # a float in JSON, with its separator, at most
TOKEN_BYTES = 96  # {"id":..,"text":..,"prob":..}


def _lens(served: ServedModel) -> LensSpec:
    """The family's lens: every model here came through app/api/deps.py's lens_model, which refuses a
    family without one."""
    lens = served.family.lens
    assert lens is not None, f"{served.describe()} declares no lens"
    return lens


def _stream_length(served: ServedModel, ids: list[int], target: list[int] | None) -> int:
    """Positions of the lens stream (at most: an encoder-decoder's default target fills the context)."""
    if _lens(served).stream == "target":
        return served.checkpoint.config.context_length if target is None else len(target) + 1
    return len(ids)


def _tokens(tok, ids: list[int]) -> list[dict]:
    return [{"id": i, "text": tok.display_text(i)} for i in ids]


def _common(served: ServedModel, report: Mapping[str, Any], echo) -> dict:
    """The fields every explain answer shares (ExplainAnswer)."""
    family, tok = served.family, served.checkpoint.tokenizer
    tokens = report["tokens"]
    translated = family.takes_target
    lens = _lens(served)
    return {"model": served.name, "family": family.name, "predicts": lens.predicts, "head": lens.head,
            "tokens": _tokens(tok, tokens["source"] if translated else tokens["tokens"]),
            "target_tokens": _tokens(tok, tokens["target"]) if translated else None,
            "generated": report["generated"] if translated else None, "ablate": echo}


def with_rows(schema: type[BaseModel], fields: dict, **rows: list | None) -> dict:
    """schema(**fields, **rows).model_dump(mode="json"), where `rows` are lists this module builds
    already in the schema's JSON shape (plain ids, texts and floats): only `fields` go through
    pydantic. Validating and dumping /lens's 1,280 rows of a 256-token answer again took ~15 ms of
    its ~85 (py-spy); tests/api/test_explain_api.py holds every answer equal to the full round trip."""
    answer = schema(**fields, **{name: [] if value is not None else None for name, value in rows.items()})
    out = answer.model_dump(mode="json")
    out.update((name, value) for name, value in rows.items() if value is not None)
    return out


def _positions(tok, stream: list[int], rows: Sequence[Mapping[str, Any]]) -> list[dict]:
    token = lambda i: None if i is None else {"id": i, "text": tok.display_text(i)}
    return [{"position": r["position"], "token": token(stream[r["position"]]), "next": token(r["next"]),
             "top": [{"id": i, "text": tok.display_text(i), "prob": p} for i, p in r["top"]],
             "next_prob": r["next_prob"], "next_logprob": r["next_logprob"]} for r in rows]


def _reached(param: str):
    """A report's check: "error" names a `param` past the end of a generated target (its length is
    known only once the model made it), a 400."""
    def check(report: dict) -> None:
        if "error" in report:
            raise ApiError(400, report["error"], param=param, code="out_of_range")
    return check


def _unknown_length(served: ServedModel, target: list[int] | None) -> bool:
    """An encoder-decoder's generated target: its length is known only once the model made it."""
    return _lens(served).stream == "target" and target is None


def _check_index(name: str, value: int, n: int, what: str) -> None:
    if not 0 <= value < n:
        raise ApiError(400, f"{name} {value} out of range: the model has {n} {what} (0..{n - 1})", param=name,
                       code="out_of_range")


def head_formula(softcap: float | None, own_scale: bool) -> str:
    """What a head computes, as the step-by-step answer shows it: its own scale (Gemma, Granite)
    and Gemma 2's soft-cap where the model has them."""
    if softcap is not None:
        return "z = softmax(cap(q K^T * scale) + mask) V, cap(s) = softcap * tanh(s / softcap)"
    return "z = softmax(q K^T * scale + mask) V" if own_scale else "z = softmax(q K^T / sqrt(d_head) + mask) V"

class ExplainServing:
    """Answers POST /logits, /lens and /attention/explain for the models in `state`."""

    def __init__(self, state: AppState):
        self.state = state

    async def logits(self, body: LogitsRequest, served: ServedModel, request: Request | None = None):
        state = self.state
        edits, echo = resolve_ablate(served, body.ablate, state.settings)
        ids, target = await read_sequence(body, served, state)
        n = 1 if body.positions == "last" else _stream_length(served, ids, target)
        per_position = (body.top_k + 2) * TOKEN_BYTES
        call = LogitsCall(ids=ids, target_ids=target, ablate=edits, top_k=body.top_k,
                          last_only=body.positions == "last")
        tok = served.checkpoint.tokenizer

        def content(report: explain.LogitsReport) -> dict:
            stream = report["stream"]
            return with_rows(LogitsResponse, _common(served, report, echo),
                             positions=_positions(tok, stream, report["positions"]),
                             clean=_positions(tok, stream, report["clean"]) if "clean" in report else None,
                             effect=report.get("effect"))

        return await answer_with_claim(state, served, call, content, what="this answer", request=request,
                                       need=n * per_position * (2 if edits else 1) + len(ids) * TOKEN_BYTES)

    async def lens(self, body: LensRequest, served: ServedModel, request: Request | None = None):
        state = self.state
        edits, echo = resolve_ablate(served, body.ablate, state.settings)
        ids, target = await read_sequence(body, served, state)
        rows = served.checkpoint.config.n_layers + 1
        n = _stream_length(served, ids, target)
        if body.positions is not None and max(body.positions) >= n and not _unknown_length(served, target):
            raise ApiError(400, f"positions {max(body.positions)} out of range: the sequence has {n} positions "
                           f"(0..{n - 1})", param="positions", code="out_of_range")
        call = LensCall(ids=ids, target_ids=target, ablate=edits, top_k=body.top_k, positions=body.positions,
                        rank=body.rank)
        tok = served.checkpoint.tokenizer

        def content(report: explain.LensReport) -> dict:
            text = tok.display_text
            actual = [None if a is None else {"id": a, "text": text(a)} for a in report["actual"]]
            label = lambda index: "embeddings" if index < 0 else f"block {index}"
            layers = [{"index": layer["index"], "label": label(layer["index"]),
                       "positions": [{"position": at, "top": [{"id": i, "text": text(i), "prob": p}
                                                              for i, p in zip(top_ids, probs)],
                                      "actual": None if a is None else {**a, "rank": rank, "prob": prob},
                                      "experts": None if routes is None else [{"expert": e, "weight": w}
                                                                              for e, w in routes]}
                                     for at, top_ids, probs, a, rank, prob, routes in zip(
                                         report["positions"], layer["top_ids"], layer["top_probs"], actual,
                                         layer["rank"], layer["prob"],
                                         layer.get("experts") or [None] * len(report["positions"]))]}
                      for layer in report["layers"]]
            return with_rows(LensResponse, _common(served, report, echo), layers=layers)

        return await answer_with_claim(state, served, call, content, what="this answer", request=request,
                                       need=rows * (n if body.positions is None else len(body.positions))
                                       * (body.top_k + 2) * TOKEN_BYTES, check=_reached("positions"))

    async def explain_head(self, body: ExplainRequest, served: ServedModel, request: Request | None = None):
        state = self.state
        family, cfg = served.family, served.checkpoint.config
        names = [g.name for g in family.groups]
        group = family.primary.name if body.group is None else body.group
        if group not in names:
            raise ApiError(400, f"{served.describe()} has no attention group {group!r}: it has {', '.join(names)}",
                           param="group", code="unknown_group")
        _check_index("layer", body.layer, cfg.n_layers, "layers")
        _check_index("head", body.head, cfg.n_heads, "heads")
        edits, echo = resolve_ablate(served, body.ablate, state.settings)
        ids, target = await read_sequence(body, served, state)
        g = family.group(group)
        lengths = {"tokens": len(ids), "source": len(ids),
                   "target": cfg.context_length if target is None else len(target) + 1}
        if body.query < 0 or (g.queries != "target" or target is not None) and body.query >= lengths[g.queries]:
            raise ApiError(400, f"query {body.query} out of range: the {g.queries} have {lengths[g.queries]} positions "
                                f"(0..{lengths[g.queries] - 1})", param="query", code="out_of_range")
        keys = lengths[g.keys]
        call = ExplainHeadCall(ids=ids, target_ids=target, group_name=group, layer=body.layer, head=body.head,
                               query=body.query, ablate=edits)
        tok = served.checkpoint.tokenizer
        score = None if body.key is None else _score_call(served, body, ids, target, group, lengths["source"])

        def content(done: explain.HeadStep | tuple[explain.HeadStep, ScoreDecomposition]) -> dict:
            report, parts = done if isinstance(done, tuple) else (done, None)
            tokens = report["tokens"]
            translated = family.takes_target
            answer = ExplainResponse(
                model=served.name, family=family.name, group=group, layer=body.layer, head=body.head, query=body.query,
                query_token={"id": report["query_id"], "text": tok.display_text(report["query_id"])},
                key_tokens=_tokens(tok, report["key_ids"]), d_head=report["d_head"], scale=report["scale"],
                kv_head=report["kv_head"], positions=explain.positions_note(cfg),
                formula=head_formula(report["softcap"], cfg.attn_scale is not None), softcap=report["softcap"],
                **{k: report[k] for k in ("q", "keys", "values", "scores", "scaled", "mask", "masked", "softmax",
                                          "pattern_row", "z")},
                tokens=_tokens(tok, tokens["source"] if translated else tokens["tokens"]),
                target_tokens=_tokens(tok, tokens["target"]) if translated else None,
                generated=report["generated"] if translated else None, ablate=echo,
                score_parts=None if parts is None else _score_parts(parts))
            out = answer.model_dump(mode="json")
            if parts is None:
                del out["score_parts"]  # an answer without `key` is as it always was
            return out

        need = (2 * keys + 4) * cfg.d_head * FLOAT_BYTES + keys * (6 * FLOAT_BYTES + TOKEN_BYTES) \
            + (lengths["tokens"] + lengths["target"]) * TOKEN_BYTES
        if score is not None:  # parts' names and two totals each, and the top pairs
            parts = cfg.n_layers * (2 * cfg.n_heads + 1) + cfg.n_heads + 4  # an encoder-decoder's most, a side
            need += 2 * parts * (2 * FLOAT_BYTES + 16) + score.top_k * 64
        reached = _reached("query")

        def check(done: Any) -> None:  # a HeadStep, or with `key` (HeadStep, ScoreDecomposition | Unreached)
            for report in done if isinstance(done, tuple) else (done,):
                reached(report)  # a query past a generated target's end
        return await answer_with_claim(state, served, call if score is None else (call, score), content,
                                       what="this answer", need=need, request=request, check=check)


def _score_call(served: ServedModel, body: ExplainRequest, ids: list[int], target: list[int] | None, group: str,
                source: int) -> ScoreDecompositionCall:
    """/attention/explain's `key`: the head's score from the query to the key split into pairs of parts
    (a pre-norm decoder's, or an encoder-decoder's head of any group; 400s naming `key`)."""
    assert body.key is not None
    cfg = served.checkpoint.config
    translated = served.family.takes_target
    if not translated and (cfg.family != "decoder" or cfg.norm != "pre"):
        raise ApiError(400, f"key (why a head attends: its score split into what wrote the residual streams) needs a "
                            f"pre-norm decoder, whose stream is the sum of what its parts wrote, or an "
                            f"encoder-decoder; {served.describe()} is "
                            f"{'post-norm' if cfg.family == 'decoder' else 'neither'}: ask without key",
                       param="key", code="unsupported")
    if body.ablate:
        raise ApiError(400, "key decomposes the unablated model's score: ask without ablate, or without key",
                       param="key", code="unsupported")
    causal = served.family.group(group).causal
    if causal and not body.key <= body.query:
        raise ApiError(400, f"key {body.key} out of range 0..{body.query}: a causal head's query sees itself and the "
                            "positions before it", param="key", code="out_of_range")
    if not causal and not body.key < source:  # an encoder or cross head's keys: the source's positions
        raise ApiError(400, f"key {body.key} out of range 0..{source - 1}: the {group} heads' keys are the source's "
                            f"{source} positions", param="key", code="out_of_range")
    call = ScoreDecompositionCall(ids=ids, layer=body.layer, head=body.head, query=body.query, key=body.key,
                                  target_ids=target, group=group if translated else None)
    try:
        call.check(cfg)
    except ValueError as e:
        raise ApiError(400, str(e), param="key", code="invalid_value") from None
    return call


def _score_parts(parts: ScoreDecomposition) -> dict:
    return {"key": parts["key"], "score": parts["score"], "softcap": parts["softcap"], "capped_score": parts["capped_score"],
            "probability": parts["probability"], "parts": parts["parts"],
            "key_parts": parts["key_parts"],
            "top_pairs": [{"query_part": p["query"], "key_part": p["key"], "value": p["value"]} for p in parts["top"]],
            "query_totals": parts["query_totals"], "key_totals": parts["key_totals"], "rest": parts["rest"]}
