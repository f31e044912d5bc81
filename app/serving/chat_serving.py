"""Serving a conversation: POST /v1/chat/completions, and `messages` on /generate and /attention.

A conversation becomes a prompt as transformers' `apply_chat_template(messages,
add_generation_prompt=True)` makes it: the checkpoint's own chat template renders the
messages (app/serving/chat_template.py) and the text is tokenised without adding special tokens
(the template writes them). Both run on worker threads. A model whose checkpoint has no
template (every bundled one) is a 400 `no_chat_template` that says how to get one.

The chat completion is OpenAI's: each choice's message, its logprobs as `content` entries
{token, logprob, bytes, top_logprobs}, and when streamed a `chat.completion.chunk` with the
role, then one per token, then one with the finish reason (a final EOS is no content: it
counts in `usage` but has no logprobs entry). The choices run as /v1/completions' do
(openai_serving.py).
"""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from attnlens.app.api.chat_schemas import ChatCompletionRequest
from attnlens.app.api.common_schemas import ChatMessage
from attnlens.app.api.generate_schemas import GeneratedTokenOut, StreamDone, StreamToken
from attnlens.app.engine import GenerationParams
from attnlens.app.registry.model_registry import CHAT, ServedModel
from attnlens.app.server.api_errors import ApiError
from attnlens.app.server.settings import Settings
from attnlens.app.server.state import AppState
from attnlens.app.serving.chat_template import ChatTemplateError, render_chat
from attnlens.app.serving.generation_streams import sse
from attnlens.app.serving.openai_serving import (
    FINISH,
    check_capacity,
    check_logit_bias,
    collect_choices,
    sampling,
    stream_choices,
    usage,
)
from attnlens.app.serving.prompts import check_text_bytes, tokenize_texts
from attnlens.app.serving.request_limits import check_lengths, check_new_token_limit


def no_template(served: ServedModel, able: list[str], param: str = "model") -> ApiError:
    hint = f"; models here that have one: {', '.join(able)}" if able else ""
    return ApiError(400, f"{served.describe()} has no chat template (its tokenizer_config.json names no "
                         f"chat_template), so it cannot render messages: send a prompt instead, or serve a "
                         f"checkpoint imported with one (attnlens import-hf --src DIR){hint}",
                    param=param, code="no_chat_template")


def require_template(state: AppState, served: ServedModel, param: str = "model") -> str:
    """The model's chat template, or the 400 that says it has none."""
    template = served.checkpoint.tokenizer.chat_template
    if CHAT not in served.tasks or template is None:
        assert state.registry is not None  # `served` came from it
        raise no_template(served, [m.name for m in state.registry.models.values() if CHAT in m.tasks], param)
    return template


async def conversation_ids(state: AppState, served: ServedModel, messages: list[ChatMessage], limit: int, *,
                           limit_name: str) -> list[int]:
    """The conversation's token ids, rendered by the model's template with the assistant's turn
    begun; at most ATTNLENS_MAX_CHAT_MESSAGES messages, and a rendered text whose bytes prove it
    longer than `limit` tokens is refused before it is tokenised."""
    template = require_template(state, served, "messages")
    settings: Settings = state.settings
    if len(messages) > settings.max_chat_messages:
        raise ApiError(400, f"messages holds {len(messages)} messages, more than the limit of "
                            f"{settings.max_chat_messages} (ATTNLENS_MAX_CHAT_MESSAGES)",
                       param="messages", code="too_many_messages")
    tok = served.checkpoint.tokenizer
    try:
        text = await run_in_threadpool(render_chat, template, [m.for_template() for m in messages],
                                       tok.template_tokens, add_generation_prompt=True)
    except ChatTemplateError as e:
        raise ApiError(400, str(e), param="messages", code="chat_template_error") from None
    check_text_bytes(tok, text, limit, field="messages", limit_name=limit_name)
    ids = (await tokenize_texts(tok, [text]))[0]
    if not ids:
        raise ApiError(400, "messages render to no tokens", param="messages", code="empty_prompt")
    return ids


class ChatChoice:
    """One choice's content and OpenAI chat logprobs, built from the engine's events."""

    def __init__(self, index: int, tokenizer, want_logprobs: bool, n_top: int):
        self.index, self.tokenizer, self.want_logprobs, self.n_top = index, tokenizer, want_logprobs, n_top
        self.content = ""
        self.logprobs: list[dict] = []

    def _entry(self, token: GeneratedTokenOut) -> dict:
        tok = self.tokenizer
        top = [{"token": a.text, "logprob": a.logprob, "bytes": list(tok.token_bytes(a.id))}
               for a in token.top_logprobs[: self.n_top]]
        return {"token": token.text, "logprob": token.logprob, "bytes": list(tok.token_bytes(token.id)),
                "top_logprobs": top}

    def add_token(self, token: StreamToken) -> dict | None:
        """Record a token; its logprobs for a chunk ({"content": [entry]}) or None."""
        self.content += token.delta
        if not self.want_logprobs:
            return None
        entry = self._entry(token)
        self.logprobs.append(entry)
        return {"content": [entry], "refusal": None}

    def add_end(self, delta: str) -> None:
        self.content += delta

    def as_dict(self, finish_reason: str) -> dict:
        return {"index": self.index, "message": {"role": "assistant", "content": self.content, "refusal": None},
                "logprobs": {"content": self.logprobs, "refusal": None} if self.want_logprobs else None,
                "finish_reason": FINISH[finish_reason]}


class ChatChunks:
    """The stream's chat.completion.chunk events (openai_serving.ChunkWriter)."""

    def __init__(self, cid: str, created: int, name: str, choices: list[ChatChoice], prompt_tokens: int,
                 include_usage: bool):
        self.head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": name,
                     "system_fingerprint": None, **({"usage": None} if include_usage else {})}
        self.choices, self.prompt_tokens = choices, prompt_tokens

    def _chunk(self, index: int, delta: dict, logprobs=None, finish_reason=None) -> str:
        return sse(None, {**self.head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                                    "finish_reason": finish_reason}]})

    def first(self) -> str:
        return "".join(self._chunk(c.index, {"role": "assistant", "content": ""}) for c in self.choices)

    def token(self, index: int, event: StreamToken) -> str:
        return self._chunk(index, {"content": event.delta}, self.choices[index].add_token(event))

    def done(self, index: int, event: StreamDone) -> str:
        self.choices[index].add_end(event.delta)
        return self._chunk(index, {"content": event.delta} if event.delta else {}, None,
                           FINISH[event.finish_reason])

    def usage(self, completion_tokens: int) -> str:
        return sse(None, {**self.head, "choices": [], "usage": usage(self.prompt_tokens, completion_tokens)})


def _new_tokens(body: ChatCompletionRequest, settings: Settings, prompt_len: int, context: int) -> tuple[int, str]:
    """How many tokens each choice may generate, and the field that says so."""
    if body.max_tokens is not None and body.max_completion_tokens is not None \
            and body.max_tokens != body.max_completion_tokens:
        raise ApiError(400, f"max_tokens ({body.max_tokens}) and max_completion_tokens "
                            f"({body.max_completion_tokens}) disagree: give one of them",
                       param="max_tokens", code="invalid_value")
    limit, field = body.token_limit
    if limit is not None:
        check_new_token_limit(settings, limit, field)
        return limit, field
    if prompt_len >= context:
        raise ApiError(400, f"messages render to {prompt_len} tokens, which leaves no room to answer in the "
                            f"model's context of {context}", param="messages", code="context_length_exceeded")
    return min(settings.max_new_tokens, context - prompt_len), "max_completion_tokens"


async def chat_completion(body: ChatCompletionRequest, served: ServedModel, request: Request, state: AppState):
    """The assistant's next turn from `served` (the chat model app/api/deps.py found for the request)."""
    engine, settings = served.runner, state.settings
    tok = engine.tokenizer
    check_logit_bias(body, tok)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_value")
    n_param = "n" if body.n > 1 else "messages"
    check_capacity(engine, 1, body.n, n_param)
    ids = await conversation_ids(state, served, body.messages, settings.prompt_limit,
                                 limit_name="ATTNLENS_MAX_PROMPT_TOKENS")
    context = engine.config.context_length
    max_new, max_field = _new_tokens(body, settings, len(ids), context)
    check_lengths(context, settings, ids, max_new, served.generation, prompt_field="messages",
                  max_field=max_field)
    n_top = body.top_logprobs or 0
    jobs = [GenerationParams(prompt_ids=ids, max_new_tokens=max_new, sampling=sampling(body, k, served),
                             stop=body.stops, n_logprobs=n_top) for k in range(body.n)]
    generations = engine.submit_all(jobs, param=n_param)  # all choices or none
    cid, created, name = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), served.name
    choices = [ChatChoice(i, tok, body.logprobs, n_top) for i in range(body.n)]
    metrics = state.metrics
    if body.stream:
        return stream_choices(generations, metrics,
                              ChatChunks(cid, created, name, choices, len(ids), body.include_usage),
                              include_usage=body.include_usage)
    outcomes = await collect_choices(request, generations, metrics)
    for c, out in zip(choices, outcomes):
        for t in out.tokens:
            c.add_token(t)
        c.add_end(out.done.delta)
    completion_tokens = sum(o.done.usage.completion_tokens for o in outcomes)
    return {"id": cid, "object": "chat.completion", "created": created, "model": name, "system_fingerprint": None,
            "choices": [c.as_dict(o.done.finish_reason) for c, o in zip(choices, outcomes)],
            "usage": usage(len(ids), completion_tokens)}
