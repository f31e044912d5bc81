"""POST /heads' serving side (app/api/heads_routes.py is the thin router): the input (text, ids or the
built-in probe) read and checked, the maps the model side will hold claimed from the answer
budget, one HeadScoresCall (model/analysis/head_atlas_scores.py) and the atlas built from its
scores (app/serving/head_atlas.py), checked against the schema and encoded."""

from __future__ import annotations

from fastapi import Request

from attnlens.app.api.heads_schemas import HeadsRequest, HeadsResponse
from attnlens.app.registry.model_registry import ServedModel
from attnlens.app.server.api_errors import ApiError, field_error
from attnlens.app.server.state import AppState
from attnlens.app.serving.answer_budget import answer_with_claim, off_loop
from attnlens.app.serving.head_atlas import (
    DEFAULT_PROBE_LENGTH,
    atlas_answer,
    clark_maps_bytes,
    clark_probe,
    maps_bytes,
    max_probe_length,
    probe_ids,
    probe_overhead,
)
from attnlens.app.serving.prompts import read_sequence, target_ids
from attnlens.model.analysis.operations import HeadScoresCall


def one_input(body: HeadsRequest) -> None:
    given = [name for name in ("text", "ids", "probe") if getattr(body, name) is not None]
    if not given:
        raise field_error("text", "give text (to tokenise), ids (token ids) or probe (the built-in probe)", "missing")
    if len(given) > 1:
        raise field_error(given[1], f"give exactly one of text, ids or probe, not {' and '.join(given)}",
                          "exclusive")


class HeadsServing:
    """Answers POST /heads for the models in `state`."""

    def __init__(self, state: AppState):
        self.state = state

    async def heads(self, body: HeadsRequest, served: ServedModel, request: Request | None = None):
        state = self.state
        family, cfg, tok = served.family, served.checkpoint.config, served.checkpoint.tokenizer
        one_input(body)
        ids, target, probe = await self._ids(body, served)
        # the maps exist only on the model's side, but they are as large as /attention's: claimed from
        # the same budget (ATTNLENS_MAX_ANSWER_BYTES) while they are computed and scored
        lengths = {"tokens": len(ids), "source": len(ids),
                   "target": cfg.context_length if target is None else len(target) + 1}
        clark = await off_loop(clark_probe, family, tok, cfg.context_length)  # None: not an encoder
        need = maps_bytes(family, lengths, cfg.n_layers, cfg.n_heads)
        if clark is not None:  # the sentences' maps come one at a time, after the input's go
            need = max(need, clark_maps_bytes(clark, family, cfg.n_layers, cfg.n_heads))
        if need > state.answers.limit:
            field = "probe.length" if probe is not None else "ids" if body.ids is not None else "text"
            raise ApiError(400, f"{field}: {len(ids)} tokens make {need / 1e6:.1f} MB of attention maps to score, "
                                f"more than ATTNLENS_MAX_ANSWER_BYTES ({state.answers.limit / 1e6:.1f} MB): use "
                                f"fewer tokens", param=field, code="answer_too_large")

        def answer(result) -> bytes:  # on a worker thread: built, checked against the schema, encoded
            fields = atlas_answer(family, result, tok, served.name, probe, clark)
            return HeadsResponse.model_validate(fields).model_dump_json().encode()

        return await answer_with_claim(state, served, HeadScoresCall(ids=ids, target_ids=target, clark=clark),
                                       answer, need=need, what="this input's attention maps", hold=False,
                                       request=request)

    async def _ids(self, body: HeadsRequest, served: ServedModel
                   ) -> tuple[list[int], list[int] | None, dict | None]:
        """The ids to score, the target and the probe's echo: the probe, or the sequence the request
        names, read as /attention reads it (app/serving/prompts.py)."""
        if body.probe is not None:
            target = await target_ids(body, served)
            ids, probe = await self._probe(body, served)
            return ids, target, probe
        ids, target = await read_sequence(body, served, self.state)
        return ids, target, None

    @staticmethod
    async def _probe(body: HeadsRequest, served: ServedModel) -> tuple[list[int], dict]:
        probe = body.probe
        assert probe is not None  # _ids builds the probe only for a request that asks for one
        family, tok = served.family, served.checkpoint.tokenizer
        most = max_probe_length(family, served.checkpoint.config.context_length)
        length = probe.length if probe.length is not None else min(DEFAULT_PROBE_LENGTH, most)
        if not 1 <= length <= most:
            raise ApiError(400, f"probe.length {length} does not fit: the probe has 2 x length + "
                                f"{probe_overhead(family)} tokens and the model's "
                                f"context is {served.checkpoint.config.context_length}, so length runs 1..{most}",
                           param="probe.length", code="context_length_exceeded")
        ids = await off_loop(probe_ids, family, tok, length, probe.seed)
        return ids, {"kind": probe.kind, "length": length, "seed": probe.seed}
