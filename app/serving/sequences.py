"""What a request names to analyse, read one way for /attention, /heads and the explain routes:
its token ids (`text` | `ids` | `messages`, a text framed as the model's family frames one) and
its target (`target` | `target_ids`, for a model that reads one), each checked against the
model's vocabulary and context with a 400 naming the field."""

from __future__ import annotations

from attnlens.app.registry.model_registry import ServedModel
from attnlens.app.server.api_errors import ApiError, field_error
from attnlens.app.server.state import AppState
from attnlens.app.serving.answer_budget import off_loop
from attnlens.app.serving.chat_serving import conversation_ids
from attnlens.app.serving.encoder_tasks import TaskInputError, framed_ids
from attnlens.app.serving.prompts import check_text_bytes, check_token_ids, tokenize_text


async def input_ids(body, state: AppState, served: ServedModel) -> list[int]:
    """The token ids to analyse: `ids` as given, `text` tokenised, or `messages` rendered with the
    model's chat template and tokenised; exactly one of them (a body without `messages`, as the
    explain routes', has the other two)."""
    tok, context_length = served.checkpoint.tokenizer, served.checkpoint.config.context_length
    given = [name for name in ("text", "ids", "messages") if getattr(body, name, None) is not None]
    if len(given) > 1:
        raise field_error(given[1], f"give one of text, ids or messages, not both {given[0]} and {given[1]}",
                          "exclusive")
    if not given:
        raise field_error("text", "give text (to tokenise), ids (token ids) or messages (a conversation)", "missing")
    if getattr(body, "messages", None) is not None:
        field, ids = "messages", await conversation_ids(state, served, body.messages, context_length,
                                                        limit_name="the model's context length")
    elif body.ids is not None:
        field, ids = "ids", check_token_ids(tok, body.ids, field="ids")
    else:
        field = "text"
        ids = await tokenize_text(tok, body.text, context_length, field="text",
                                  limit_name="the model's context length", prompt=True)
        if not ids:
            raise ApiError(400, "text encodes to no tokens", param="text", code="empty_text")
    if len(ids) > context_length:
        raise ApiError(400, f"{field} has {len(ids)} tokens, more than the model's context length of "
                            f"{context_length}", param=field, code="context_length_exceeded")
    return ids


async def target_ids(body, served: ServedModel) -> list[int] | None:
    """The target of a family that reads one (an encoder-decoder): `target` tokenised or `target_ids`
    as they are, or None (then the model's greedy output). The decoder reads start + target:
    context - 1 at most. Any other family refuses a target."""
    if body.target is None and body.target_ids is None:
        return None
    if not served.family.takes_target:
        name = "target" if body.target is not None else "target_ids"
        raise field_error(name, f"only a model that reads a source and writes a target (an encoder-decoder) "
                                f"takes a target; {served.describe()}", "unsupported")
    tok, context_length = served.checkpoint.tokenizer, served.checkpoint.config.context_length
    if body.target is not None and body.target_ids is not None:
        raise field_error("target_ids", "give either target or target_ids, not both", "exclusive")
    if body.target_ids is not None:
        field, ids = "target_ids", list(body.target_ids)
        for pos, i in enumerate(ids):
            if not 0 <= i < tok.vocab_size:
                raise field_error("target_ids", f"token id {i} (at position {pos}) is not in the vocabulary: "
                                                f"ids run 0..{tok.vocab_size - 1}", "out_of_range")
    else:  # checked by its bytes, then tokenised off the event loop (as `text` is)
        field, ids = "target", await tokenize_text(tok, body.target, context_length - 1, field="target",
                                                   limit_name="the model's context length")
        if not ids:
            raise ApiError(400, "target encodes to no tokens", param="target", code="empty_text")
    if len(ids) + 1 > context_length:
        raise ApiError(400, f"{field} has {len(ids)} tokens; with the decoder's start token that is more than "
                            f"the model's context length of {context_length}", param=field,
                       code="context_length_exceeded")
    return ids


async def read_sequence(body, served: ServedModel, state: AppState) -> tuple[list[int], list[int] | None]:
    """The ids a request names (`text` | `ids` | `messages`, a text framed as the family frames one) and
    its target (`target` | `target_ids`, or None): what /attention and the explain routes analyse."""
    family, cfg, tok = served.family, served.checkpoint.config, served.checkpoint.tokenizer
    target = await target_ids(body, served)
    if (family.framing == "cls_sep" and body.text is not None and body.ids is None
            and getattr(body, "messages", None) is None):
        check_text_bytes(tok, body.text, cfg.context_length, field="text", limit_name="the model's context length")
        try:
            ids = await off_loop(framed_ids, served.checkpoint, body.text)
        except TaskInputError as e:
            raise ApiError(400, str(e), param=e.param, code=e.code) from None
    else:
        ids = await input_ids(body, state, served)
    return ids, target
