"""POST /patch and POST /logit-attribution's serving side (app/api/causes_routes.py is the thin router):
one request -> one model call -> one answer, as the explain routes (explain_serving.py).

Each route reads its prompts (`clean` | `clean_ids`, `corrupted` | `corrupted_ids`; `text` | `ids`;
an encoder-decoder's are its sources, with one `target` | `target_ids`, as /attention reads it)
and its answer and foil (one token's text, or its id), checks them against the model with a 400
naming the field (the operation's own check, model/analysis/operations.py, is the last word: its
ValueError is a 400 too, never a 500), bounds the prompt by ATTNLENS_MAX_PATCH_TOKENS, claims the
answer's bytes from the answer budget and runs PatchCall or LogitAttributionCall on the model's
line (its engine steps the call at its report points and stops it when the client goes).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from attnlens.app.api.causes_schemas import (
    LogitAttributionRequest,
    LogitAttributionResponse,
    PatchRequest,
    PatchResponse,
)
from attnlens.app.registry.model_registry import ServedModel
from attnlens.app.server.api_errors import ApiError, field_error
from attnlens.app.server.state import AppState
from attnlens.app.serving.answer_budget import answer_with_claim
from attnlens.app.serving.explain_serving import FLOAT_BYTES, TOKEN_BYTES, with_rows
from attnlens.app.serving.prompts import check_token_ids, target_ids, tokenize_text
from attnlens.model.analysis.logit_attribution import LogitAttribution
from attnlens.model.analysis.operations import LogitAttributionCall, PatchCall
from attnlens.model.analysis.patching import PatchResult

BY_POSITION = ("heads_by_position", "residual", "layers")  # a run per position patched


def tokens_of(served: ServedModel, ids: list[int]) -> list[dict]:
    tok = served.checkpoint.tokenizer
    return [{"id": i, "text": tok.display_text(i)} for i in ids]


async def prompt_ids(state: AppState, served: ServedModel, text: str | None, ids: list[int] | None,
                     text_name: str, ids_name: str) -> tuple[list[int], str]:
    """(the prompt's token ids, the field they came from): `text` tokenised as /attention tokenises a
    decoder's prompt, or `ids` as they are; exactly one, within the model's context."""
    cfg, tok = served.checkpoint.config, served.checkpoint.tokenizer
    if text is not None and ids is not None:
        raise field_error(ids_name, f"give either {text_name} or {ids_name}, not both", "exclusive")
    if text is None and ids is None:
        raise field_error(text_name, f"give {text_name} (text to tokenise) or {ids_name} (token ids)", "missing")
    if ids is not None:
        field, got = ids_name, check_token_ids(tok, ids, field=ids_name)
    else:
        assert text is not None
        field = text_name
        got = await tokenize_text(tok, text, cfg.context_length, field=text_name,
                                  limit_name="the model's context length", prompt=True)
        if not got:
            raise ApiError(400, f"{text_name} encodes to no tokens", param=text_name, code="empty_text")
    if len(got) > cfg.context_length:
        raise ApiError(400, f"{field} has {len(got)} tokens, more than the model's context length of "
                            f"{cfg.context_length}", param=field, code="context_length_exceeded")
    return got, field


def decoder_tokens(served: ServedModel, target: list[int] | None) -> list[dict] | None:
    """An encoder-decoder's target as its decoder reads it, the start token first (None for a decoder)."""
    return None if target is None else tokens_of(served, [served.checkpoint.config.decoder_start_id, *target])


def target_field(body) -> str:
    return "target" if body.target is not None else "target_ids"


def one_token(served: ServedModel, text: str | None, token_id: int | None, name: str, *,
              required: bool = True) -> int | None:
    """The id of `name` (one token's text) or of `name`_id; exactly one of them (or neither, when not
    `required`: None)."""
    id_name = f"{name}_id"
    tok = served.checkpoint.tokenizer
    if text is not None and token_id is not None:
        raise field_error(id_name, f"give either {name} or {id_name}, not both", "exclusive")
    if token_id is not None:
        if not 0 <= token_id < tok.vocab_size:
            raise field_error(id_name, f"token id {token_id} is not in the vocabulary: ids run 0..{tok.vocab_size - 1}",
                              "out_of_range")
        return token_id
    if text is None:
        if required:
            raise field_error(name, f"give {name} (one token's text) or {id_name} (its id)", "missing")
        return None
    if len(text) > 256:
        raise ApiError(400, f"{name} is {len(text)} characters long: give the text of one token", param=name,
                       code="not_one_token")
    ids = tok.encode(text)
    if len(ids) != 1:
        shown = " + ".join(repr(tok.display_text(i)) for i in ids[:8]) + (" + ..." if len(ids) > 8 else "")
        raise ApiError(400, f"{name} {text!r} is {len(ids)} tokens ({shown or 'none'}), not one: give the text of "
                            f"one token (e.g. {repr(tok.display_text(ids[0])) if ids else repr(' Mary')}) or "
                            f"{id_name}", param=name, code="not_one_token")
    return ids[0]


def check_position(position: int | None, n: int, target: list[int] | None = None) -> None:
    """`position` within the prompt's n tokens (an encoder-decoder's: its target's, start token first)."""
    what = "the prompt has" if target is None else "the target has, the decoder's start token first,"
    n = n if target is None else len(target) + 1
    if position is not None and not 0 <= position < n:
        raise ApiError(400, f"position {position} out of range: {what} {n} tokens (0..{n - 1})",
                       param="position", code="out_of_range")


async def read_target(served: ServedModel, body) -> list[int] | None:
    """An encoder-decoder's target (`target` | `target_ids`; none given: []), None for a decoder (which
    refuses one with a 400 naming it)."""
    got = await target_ids(body, served)
    return (got or []) if served.family.takes_target else None


def checked(call: Any, served: ServedModel, fields: dict[str, str]) -> None:
    """The operation's own check (model/analysis/operations.py): its ValueError as a 400 naming the
    field its message starts with (`fields` maps the operation's names to the request's)."""
    try:
        call.check(served.checkpoint.config)
    except ValueError as e:
        message = str(e)
        first = message.split(" ", 1)[0].rstrip(":")
        param = fields.get(first, first if first in fields.values() else "model")
        raise ApiError(400, message, param=param, code="unsupported" if param == "model" else "invalid_value") \
            from None


def patch_cells(component: str, L: int, H: int, T: int, target: list[int] | None = None) -> int:
    """The floats of a /patch answer's values (an encoder-decoder's: T source and N target positions)."""
    if target is None:
        return {"heads": L * H, "heads_by_position": L * T * H, "residual": L * T, "layers": 2 * L * T,
                "paths": 3 * L * H}[component]
    N = len(target) + 1
    return {"heads": 3 * L * H, "heads_by_position": L * (T + 2 * N) * H, "residual": L * (T + N),
            "layers": L * (2 * T + 3 * N), "paths": 9 * L * H}[component]


def sender_group_of(served: ServedModel, group: str | None) -> str | None:
    """The sender's group as PatchCall takes it: an encoder-decoder's (required, one of its groups); a
    decoder's None (its one group, named or not). 400s naming `sender`."""
    names = [g.name for g in served.family.groups]
    if not served.family.takes_target:
        if group not in (None, *names):
            raise ApiError(400, f"sender group {group!r}: {served.describe()} has one attention group, "
                                f"{names[0]}; give the sender's layer and head", param="sender", code="unknown_group")
        return None
    if group is None:
        raise ApiError(400, f"sender needs a group: {served.describe()} has {', '.join(names)} heads (e.g. "
                            f'{{"group": "cross", "layer": 0, "head": 1}})', param="sender", code="missing")
    if group not in names:
        raise ApiError(400, f"sender group {group!r}: {served.describe()} has {', '.join(names)} heads",
                       param="sender", code="unknown_group")
    return group


class CausesServing:
    """Answers POST /patch and POST /logit-attribution for the models in `state`."""

    def __init__(self, state: AppState):
        self.state = state

    async def patch(self, body: PatchRequest, served: ServedModel, request: Request | None = None):
        state, cfg = self.state, served.checkpoint.config
        target = await read_target(served, body)
        clean, clean_field = await prompt_ids(state, served, body.clean, body.clean_ids, "clean", "clean_ids")
        corrupted, corrupted_field = await prompt_ids(state, served, body.corrupted, body.corrupted_ids, "corrupted",
                                                      "corrupted_ids")
        if len(corrupted) != len(clean):
            raise ApiError(400, f"{corrupted_field} has {len(corrupted)} tokens and {clean_field} {len(clean)}: the "
                                "corrupted prompt must have as many tokens as the clean one (patching swaps "
                                "activations position by position)", param=corrupted_field, code="length_mismatch")
        answer = one_token(served, body.answer, body.answer_id, "answer")
        foil = one_token(served, body.foil, body.foil_id, "foil")
        assert answer is not None and foil is not None  # required
        check_position(body.position, len(clean), target)
        limit = state.settings.max_patch_tokens
        if target is not None and len(target) + 1 > limit:
            raise ApiError(400, f"{body.component} over {limit} target tokens (the target has {len(target) + 1} with "
                                f"the start token, ATTNLENS_MAX_PATCH_TOKENS): ask for a shorter target",
                           param=target_field(body), code="prompt_too_long")
        if len(clean) > limit:
            if body.method == "exact" and body.component in BY_POSITION:
                instead = "ask for component heads (every position at once), method attribution, or a shorter prompt"
            else:
                instead = "ask for a shorter prompt"
            raise ApiError(400, f"{body.component} over {limit} tokens ({clean_field} has {len(clean)}, "
                                f"ATTNLENS_MAX_PATCH_TOKENS): {instead}", param=clean_field, code="prompt_too_long")
        sender: tuple[int, int] | None = None
        sender_group: str | None = None
        if body.component == "paths":
            if body.method != "exact":
                raise ApiError(400, "component paths is patched exactly only: ask for method exact", param="method",
                               code="invalid_value")
            if body.sender is None:
                raise ApiError(400, "component paths needs a sender {layer, head}: the head whose write is patched "
                                    "along its paths", param="sender", code="missing")
            for name, value, n in (("layer", body.sender.layer, cfg.n_layers), ("head", body.sender.head, cfg.n_heads)):
                if not 0 <= value < n:
                    raise ApiError(400, f"sender {name} {value} out of range: the model has {n} {name}s (0..{n - 1})",
                                   param="sender", code="out_of_range")
            sender = (body.sender.layer, body.sender.head)
            sender_group = sender_group_of(served, body.sender.group)
        elif body.sender is not None:
            raise ApiError(400, f"sender is for component paths only (this request asks for {body.component})",
                           param="sender", code="invalid_value")
        call = PatchCall(clean_ids=clean, corrupted_ids=corrupted, answer_id=answer, foil_id=foil,
                         position=body.position, component=body.component, method=body.method, sender=sender,
                         target_ids=target, sender_group=sender_group)
        checked(call, served, {"clean_ids": clean_field, "corrupted_ids": corrupted_field, "answer_id": "answer_id",
                               "foil_id": "foil_id", "position": "position", "component": "component",
                               "method": "method", "sender": "sender", "target_ids": target_field(body)})
        differing = [i for i, (a, b) in enumerate(zip(clean, corrupted)) if a != b]
        T = len(clean)

        def content(result: PatchResult) -> dict:
            fields = {"model": served.name, "component": result.component, "method": result.method,
                      "position": result.position, "clean_metric": result.clean_metric,
                      "corrupted_metric": result.corrupted_metric,
                      "sender": None if result.sender is None else {"layer": result.sender[0], "head": result.sender[1],
                                                                     "group": result.sender_group
                                                                     or served.family.primary.name},
                      "clean_tokens": tokens_of(served, clean), "corrupted_tokens": tokens_of(served, corrupted),
                      "target_tokens": decoder_tokens(served, target), "differing": differing,
                      "answer": tokens_of(served, [answer])[0], "foil": tokens_of(served, [foil])[0]}
            return with_rows(PatchResponse, fields, values=result.values)

        need = (patch_cells(body.component, cfg.n_layers, cfg.n_heads, T, target) * FLOAT_BYTES
                + (2 * T + len(target or ())) * TOKEN_BYTES + 1024)
        return await answer_with_claim(state, served, call, content, need=need, what=f"{body.component}'s answer",
                                       instead="ask for component heads, or a shorter prompt", request=request)

    async def logit_attribution(self, body: LogitAttributionRequest, served: ServedModel,
                                request: Request | None = None):
        state, cfg = self.state, served.checkpoint.config
        ids, field = await prompt_ids(state, served, body.text, body.ids, "text", "ids")
        target = await read_target(served, body)
        answer = one_token(served, body.answer, body.answer_id, "answer", required=False)
        foil = one_token(served, body.foil, body.foil_id, "foil", required=False)
        check_position(body.position, len(ids), target)
        call = LogitAttributionCall(ids=ids, answer_id=answer, foil_id=foil, position=body.position, target_ids=target)
        checked(call, served, {"ids": field, "answer_id": "answer_id", "foil_id": "foil_id", "position": "position",
                               "target_ids": target_field(body)})

        def content(result: LogitAttribution) -> dict:
            fields = {"model": served.name, "tokens": tokens_of(served, ids), "position": result["position"],
                      "target_tokens": decoder_tokens(served, target),
                      "answer": tokens_of(served, [result["answer_id"]])[0],
                      "foil": tokens_of(served, [result["foil_id"]])[0],
                      **{k: result[k] for k in ("answer_logit", "foil_logit", "logit_difference", "embedding",
                                                "other", "other_parts", "softcap", "capped_logit_difference")}}
            heads = result["heads"]
            if isinstance(heads, dict):  # an encoder-decoder's {decoder, cross}: validated as it is (2LH floats)
                return with_rows(LogitAttributionResponse, {**fields, "heads": heads}, mlps=result["mlps"])
            return with_rows(LogitAttributionResponse, fields, heads=heads, mlps=result["mlps"])

        heads = 2 * cfg.n_heads if target is not None else cfg.n_heads  # an encoder-decoder's: decoder and cross
        need = (cfg.n_layers * (heads + 1) + 16) * FLOAT_BYTES + (len(ids) + len(target or ())) * TOKEN_BYTES + 1024
        return await answer_with_claim(state, served, call, content, need=need, what="this answer",
                                       instead="no attribution of this model fits it", request=request)
