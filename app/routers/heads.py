"""POST /heads: the head atlas. Every head of every attention group the model's family declares,
scored on a text, on token ids, or on the built-in repeated-random probe, with a role per head
(app/head_atlas.py; the definitions are model/head_scores.py's)."""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter, Depends, Response

from ..answers import off_loop
from ..deps import get_state
from ..errors import ApiError, field_error
from ..head_atlas import (DEFAULT_PROBE_LENGTH, atlas_answer, clark_probe, maps_bytes, max_probe_length,
                          probe_ids, probe_overhead, score_heads)
from ..heads_schemas import HeadsRequest, HeadsResponse
from ..registry import ATTENTION, ServedModel, lookup
from ..sequences import read_sequence, target_ids
from ..state import AppState

router = APIRouter(tags=["heads"])


def _one_input(body: HeadsRequest) -> None:
    given = [name for name in ("text", "ids", "probe") if getattr(body, name) is not None]
    if not given:
        raise field_error("text", "give text (to tokenise), ids (token ids) or probe (the built-in probe)", "missing")
    if len(given) > 1:
        raise field_error(given[1], f"give exactly one of text, ids or probe, not {' and '.join(given)}",
                          "exclusive")


async def _probe(body: HeadsRequest, served: ServedModel) -> tuple[list[int], dict]:
    family, tok = served.family, served.checkpoint.tokenizer
    most = max_probe_length(family, served.checkpoint.config.context_length)
    length = body.probe.length if body.probe.length is not None else min(DEFAULT_PROBE_LENGTH, most)
    if not 1 <= length <= most:
        raise ApiError(400, f"probe.length {length} does not fit: the probe has 2 x length + "
                            f"{probe_overhead(family)} tokens and the model's "
                            f"context is {served.checkpoint.config.context_length}, so length runs 1..{most}",
                       param="probe.length", code="context_length_exceeded")
    ids = await off_loop(probe_ids, family, tok, length, body.probe.seed)
    return ids, {"kind": body.probe.kind, "length": length, "seed": body.probe.seed}


async def _ids(body: HeadsRequest, state: AppState, served: ServedModel
               ) -> tuple[list[int], list[int] | None, dict | None]:
    """The ids to score, the target and the probe's echo: the probe, or the sequence the request
    names, read as /attention reads it (app/sequences.py)."""
    if body.probe is not None:
        target = await target_ids(body, served)
        ids, probe = await _probe(body, served)
        return ids, target, probe
    ids, target = await read_sequence(body, served, state)
    return ids, target, None


@router.post(
    "/heads",
    response_model=HeadsResponse,
    responses={400: {"description": "text, ids or the probe longer than the model's context, or its attention "
                                    "maps larger than ATTNLENS_MAX_ANSWER_BYTES (the message gives the numbers)"},
               404: {"description": "unknown model"}, 413: {},
               429: {"description": "too many model calls running or waiting (ATTNLENS_MAX_ATTENTION_CONCURRENT; "
                                    "for a model that does not generate ATTNLENS_MAX_ENCODER_CONCURRENT + "
                                    "ATTNLENS_MAX_QUEUE), or maps in flight over ATTNLENS_MAX_ANSWER_BYTES for "
                                    "ATTNLENS_ANSWER_WAIT_S; see Retry-After"}, 503: {}},
)
async def heads(body: HeadsRequest, state: AppState = Depends(get_state)):
    """Per-head scores and roles of every attention group, on `text`, `ids` or `probe` (exactly one).

    Scores come from the attention maps /attention shows. previous_token, duplicate_token and
    induction are TransformerLens's head detector ("mul", no exclusions) on a causal group, their
    bidirectional analogues (and next_token) on an encoder's; every self group also has
    first_token, self, entropy and mean_distance; a cross group alignment, first_token and
    entropy. An encoder's heads also get Clark et al.'s (2019) scores, clark_cls, clark_sep,
    clark_punctuation, clark_previous, clark_next and clark_entropy (nats), on fixed English
    sentences (`clark_sentences`) whatever the input, and the roles cls, sep and punctuation.
    `definitions` says each in one line and `thresholds` which score a role needed.
    The probe {"kind": "repeated_random", "length": n, "seed": s} is BOS + n random tokens + the
    same n, where an induction head shows (about 0.5 at most on a causal model).
    """
    served = lookup(state, body.model, ATTENTION)
    family, cfg, tok = served.family, served.checkpoint.config, served.checkpoint.tokenizer
    _one_input(body)
    ids, target, probe = await _ids(body, state, served)
    # the maps exist only on the model's side, but they are as large as /attention's: claimed from
    # the same budget (ATTNLENS_MAX_ANSWER_BYTES) while they are computed and scored
    lengths = {"tokens": len(ids), "source": len(ids),
               "target": cfg.context_length if target is None else len(target) + 1}
    clark = await off_loop(clark_probe, family, tok, cfg.context_length)  # None: not an encoder
    need = maps_bytes(family, lengths, cfg.n_layers, cfg.n_heads)
    if clark is not None:  # the sentences' maps come one at a time, after the input's go
        need = max(need, clark.maps_bytes(family, cfg.n_layers, cfg.n_heads))
    if need > state.answers.limit:
        field = "probe.length" if probe is not None else "ids" if body.ids is not None else "text"
        raise ApiError(400, f"{field}: {len(ids)} tokens make {need / 1e6:.1f} MB of attention maps to score, more "
                            f"than ATTNLENS_MAX_ANSWER_BYTES ({state.answers.limit / 1e6:.1f} MB): use fewer tokens",
                       param=field, code="answer_too_large")
    claim = await state.answers.claim(need, what="this input's attention maps")
    try:
        result = await served.call_model(partial(score_heads, ids=ids, target_ids=target, clark=clark))
    finally:
        await claim.release()

    def answer() -> bytes:  # on a worker thread: built, checked against the schema, encoded
        fields = atlas_answer(family, result, tok, served.name, probe, clark)
        return HeadsResponse.model_validate(fields).model_dump_json().encode()

    return Response(await off_loop(answer), media_type="application/json")
