"""The OpenAI-compatible routes' serving side (app/api/chat_routes.py and app/api/openai_routes.py
are the thin routers): POST /v1/chat/completions and POST /v1/completions.

What both share: the 404 for a model /v1 does not list, what a request's choices would claim,
each choice's sampling (the request's fields, else the model's recommended ones read at load,
else OpenAI's defaults), and running the choices' generations, as one answer or as one stream of
`data:` chunks ending `[DONE]`. A route says only how its chunks and choices look:
`stream_choices` takes a `ChunkWriter` (the first chunks, one per token, one per end, the usage
chunk) and runs the rest: the generations' events merged as they come (every event already
waiting goes out in one write), an engine error as OpenAI's error object, a client that goes away
cancelling every choice.

Chat: the conversation rendered by the model's chat template (app/serving/prompts.py); each
choice's message, its logprobs as `content` entries {token, logprob, bytes, top_logprobs}, and
when streamed a `chat.completion.chunk` with the role, then one per token, then one with the
finish reason (a final EOS is no content: it counts in `usage` but has no logprobs entry).

Completions (OpenAI's legacy API): the request's options checked (`suffix` is refused; `best_of`
>= `n`, and not streamed when it is larger), its prompts counted before any is tokenised (prompts
x choices that could never fit in the server's places are a 400 at once), every prompt checked
(strings by their bytes, ids by their count and vocabulary) and the strings tokenised together on
a worker thread that lets go of the GIL; then one generation per prompt and candidate, all
admitted at once or none, and their events as one Completion (the `n` best of `best_of` by
log-probability per token) or as OpenAI's stream of chunks.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import time
import uuid
from typing import Any, AsyncIterator, Protocol

from fastapi import Request
from fastapi.responses import StreamingResponse

from attnlens.app.api.chat_schemas import ChatCompletionRequest
from attnlens.app.api.generate_schemas import GeneratedTokenOut, StreamDone, StreamToken
from attnlens.app.api.openai_schemas import OPENAI_SAMPLING, CompletionRequest, OpenAIErrorResponse, SamplingRequest
from attnlens.app.engine import EngineFront, GenerationParams, RequestState, RequestTooLarge
from attnlens.app.registry.model_registry import COMPLETIONS, ModelRegistry, ServedModel
from attnlens.app.server.api_errors import ApiError, public_message
from attnlens.app.server.middleware import Metrics
from attnlens.app.server.settings import Settings
from attnlens.app.server.state import AppState
from attnlens.app.serving.generation_streams import (
    SSE_HEADERS,
    Outcome,
    cancel_on_disconnect,
    collect,
    note_unfinished,
    scored_token,
    sse,
)
from attnlens.app.serving.generation_streams import events as request_events
from attnlens.app.serving.prompts import (
    check_lengths,
    check_new_token_limit,
    check_text_bytes,
    check_token_ids,
    conversation_ids,
    tokenize_texts,
)
from attnlens.model import SamplingParams

log = logging.getLogger("attnlens.routers")

ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": OpenAIErrorResponse} for code in (400, 401, 404, 408, 413, 422, 429, 503)}
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def not_found(registry: ModelRegistry, name: str) -> ApiError:
    """OpenAI's 404 for a model: it names only the models GET /v1/models lists."""
    listed = [m.name for m in registry.models.values() if COMPLETIONS in m.tasks]
    return ApiError(404, f"the model {name!r} does not exist; the models here are: {', '.join(listed)} "
                         f"(GET /v1/models)", param="model", code="model_not_found")


def check_logit_bias(body: SamplingRequest, tok) -> None:
    for key in body.logit_bias or {}:
        if int(key) >= tok.vocab_size:
            raise ApiError(400, f"logit_bias names token {key}, which is not in the vocabulary: ids run "
                                f"0..{tok.vocab_size - 1}", param="logit_bias", code="invalid_value")


def check_capacity(engine: EngineFront, prompts: int, choices: int, param: str) -> None:
    """Prompts x choices the server can never hold at once: a 400 before anything is tokenised."""
    needed = prompts * choices
    capacity = engine.max_concurrent + engine.max_queue
    if needed > capacity:
        raise RequestTooLarge(
            f"this request needs {needed} generations at once ({prompts} prompt(s) x {choices} choices), more "
            f"than the server can ever hold: {engine.max_concurrent} running + {engine.max_queue} waiting "
            "(ATTNLENS_MAX_CONCURRENT + ATTNLENS_MAX_QUEUE); send fewer prompts or fewer choices per request",
            param=param)


def _first_set(*values):
    """The first value that is not None (the request's, the model's, the API's)."""
    return next(v for v in values if v is not None)


def sampling(body: SamplingRequest, k: int, served: ServedModel) -> SamplingParams:
    """Choice k's sampling: each field the request leaves unset is the model's recommended one (its
    generation_config.json, read at load), else OpenAI's default (top_k 0 or less: off); with a
    seed, choice k uses seed + k (the choices differ, yet repeat)."""
    model = served.sampling.defaults
    top_k = _first_set(body.top_k, model.top_k, OPENAI_SAMPLING.top_k, 0)
    bias = {int(key): v for key, v in body.logit_bias.items()} if body.logit_bias else None
    seed = None if body.seed is None else (body.seed + k) % 2**63
    return SamplingParams(temperature=_first_set(body.temperature, model.temperature, OPENAI_SAMPLING.temperature),
                          top_p=_first_set(body.top_p, model.top_p, OPENAI_SAMPLING.top_p),
                          top_k=top_k if top_k > 0 else None, seed=seed, logit_bias=bias,
                          presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty)


def stop_strings(body: SamplingRequest) -> list[str]:
    """The request's `stop` (one string, a list, or none) as a list."""
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])


def include_usage(body: SamplingRequest) -> bool:
    """stream_options {"include_usage": true}: a last chunk with the usage."""
    return bool((body.stream_options or {}).get("include_usage"))


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def collect_choices(request: Request, generations: list[RequestState], metrics: Metrics) -> list[Outcome]:
    """Every choice run to its end (a client that goes away cancels them all)."""
    async with cancel_on_disconnect(request, generations):
        return list(await asyncio.gather(*(collect(g, metrics) for g in generations)))


class ChunkWriter(Protocol):
    """How one route's stream looks: each method returns the SSE text to send (sse(None, chunk))."""

    def first(self) -> str: ...  # before any token ("" for none)

    def token(self, index: int, event: StreamToken) -> str: ...

    def done(self, index: int, event: StreamDone) -> str: ...

    def usage(self, completion_tokens: int) -> str: ...  # after every choice ended (include_usage)


def _error_chunk(message: str, code: str) -> str:
    return sse(None, {"error": {"message": message, "type": "server_error", "param": None, "code": code}})


async def _stream(generations: list[RequestState], metrics: Metrics, writer: ChunkWriter,
                  include_usage: bool) -> AsyncIterator[str]:
    merged: asyncio.Queue = asyncio.Queue()

    async def forward(i: int, g: RequestState):
        async for ev in request_events(g):
            await merged.put((i, ev))

    tasks = [asyncio.create_task(forward(i, g)) for i, g in enumerate(generations)]
    completion_tokens, ended = 0, 0
    try:
        if first := writer.first():
            yield first
        remaining = len(generations)
        while remaining:
            waiting = [await merged.get()]  # and every event already waiting: one write
            while not merged.empty():
                waiting.append(merged.get_nowait())
            out = []
            for i, ev in waiting:
                if isinstance(ev, StreamToken):
                    out.append(writer.token(i, ev))
                elif isinstance(ev, StreamDone):
                    remaining -= 1
                    ended += 1
                    completion_tokens += ev.usage.completion_tokens
                    metrics.observe_generation(ev)
                    out.append(writer.done(i, ev))
                else:
                    ended += 1
                    note_unfinished(metrics, "error")
                    out.append(_error_chunk(public_message(ev.message), ev.code or "generation_failed"))
                    yield "".join(out)
                    return
            yield "".join(out)
        if include_usage:
            yield writer.usage(completion_tokens)
        yield "data: [DONE]\n\n"
    except Exception:
        log.exception("stream failed")
        yield _error_chunk("internal error (see the server log)", "internal_error")
    finally:
        note_unfinished(metrics, "cancelled", len(generations) - ended)  # their client went away
        for t in tasks:
            t.cancel()
        for g in generations:
            g.cancel()


def stream_choices(generations: list[RequestState], metrics: Metrics, writer: ChunkWriter, *,
                   include_usage: bool) -> StreamingResponse:
    """OpenAI's stream of the choices' chunks, as `writer` writes them, then `data: [DONE]`."""
    return StreamingResponse(_stream(generations, metrics, writer, include_usage), media_type="text/event-stream",
                             headers=SSE_HEADERS)


def stream_description(what: str, chunk: str) -> dict:
    """The OpenAPI description of a 200 that is JSON, or with stream=true OpenAI's SSE chunks."""
    return {"description": f"a {what}, or with stream=true OpenAI's stream: `data:` events each holding a JSON "
                           f"chunk ({chunk}), or an `error` object, then `data: [DONE]`",
            "content": {"text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {
                "data": {"type": "string", "description": f"a JSON chunk ({chunk}), an error object, or [DONE]"}}}}}}


# --- POST /v1/chat/completions --------------------------------------------------
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
    """The stream's chat.completion.chunk events (a ChunkWriter)."""

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
    # max_completion_tokens is OpenAI's newer name: it says so when both are given (and agree)
    limit, field = ((body.max_completion_tokens, "max_completion_tokens") if body.max_completion_tokens is not None
                    else (body.max_tokens, "max_tokens"))
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
                             stop=stop_strings(body), n_logprobs=n_top) for k in range(body.n)]
    generations = engine.submit_all(jobs, param=n_param)  # all choices or none
    cid, created, name = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), served.name
    choices = [ChatChoice(i, tok, body.logprobs, n_top) for i in range(body.n)]
    metrics = state.metrics
    if body.stream:
        with_usage = include_usage(body)
        return stream_choices(generations, metrics, ChatChunks(cid, created, name, choices, len(ids), with_usage),
                              include_usage=with_usage)
    outcomes = await collect_choices(request, generations, metrics)
    for c, out in zip(choices, outcomes):
        for t in out.tokens:
            c.add_token(t)
        c.add_end(out.done.delta)
    completion_tokens = sum(o.done.usage.completion_tokens for o in outcomes)
    return {"id": cid, "object": "chat.completion", "created": created, "model": name, "system_fingerprint": None,
            "choices": [c.as_dict(o.done.finish_reason) for c, o in zip(choices, outcomes)],
            "usage": usage(len(ids), completion_tokens)}


# --- POST /v1/completions -------------------------------------------------------
def _top(alts: list[dict] | None) -> dict[str, float] | None:
    if alts is None:
        return None
    return {a["text"]: a["logprob"] for a in alts}


class Choice:
    """Builds one choice's text and legacy logprobs object from the engine's events."""

    def __init__(self, index: int, prompt: str, want_logprobs: bool, echo: bool, tokenizer, n_alternatives: int = 0):
        self.index = index
        self.n_alternatives = n_alternatives
        self.tokenizer = tokenizer
        self.want_logprobs = want_logprobs
        self.text = prompt if echo else ""
        self.offset = 0  # characters before the next token
        self.lp: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self.echo = echo

    def add_prompt_scores(self, scores: list[dict]) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        for s in scores:
            self._append(s["text"], s["logprob"], _top(s["top_logprobs"]))
            self.offset += len(decoder.decode(self.tokenizer.token_bytes(s["id"]), final=False))
        self.offset = len(self.text)  # the prompt exactly as the client sent it

    def add_token(self, token: StreamToken) -> dict | None:
        """Record a token; return its logprobs fragment (for a stream chunk) or None."""
        top = {a.text: a.logprob for a in token.top_logprobs} if self.n_alternatives else None
        frag = self._append(token.text, token.logprob, top)
        self.text += token.delta
        self.offset += len(token.delta)
        return frag

    def add_end(self, delta: str, eos: GeneratedTokenOut | None) -> dict | None:
        """The text no token carried, then the generated EOS if there was one: it counts as a
        completion token, so it gets its logprobs entry (text stays as it is)."""
        self.text += delta
        self.offset += len(delta)
        if eos is None:
            return None
        top = {a.text: a.logprob for a in eos.top_logprobs} if self.n_alternatives else None
        return self._append(eos.text, eos.logprob, top)

    def _append(self, text: str, logprob: float | None, top: dict | None) -> dict | None:
        if not self.want_logprobs:
            return None
        frag: dict[str, list] = {"tokens": [text], "token_logprobs": [logprob], "top_logprobs": [top],
                                 "text_offset": [self.offset]}
        for k, v in frag.items():
            self.lp[k].extend(v)
        return frag

    def as_dict(self, finish_reason: str) -> dict:
        return {"index": self.index, "text": self.text, "logprobs": self.lp if self.want_logprobs else None,
                "finish_reason": FINISH[finish_reason]}


def _check_options(body: CompletionRequest, tok) -> None:
    """What OpenAI's API takes but this server cannot do, or does not take in this combination: a 400."""
    if body.suffix:
        raise ApiError(400, "suffix is not supported: the models here continue a prompt, they do not fill in "
                            "text before a suffix", param="suffix", code="unsupported")
    if body.best_of is not None and body.best_of < body.n:
        raise ApiError(400, f"best_of ({body.best_of}) must be at least n ({body.n})", param="best_of",
                       code="invalid_value")
    if body.stream and (body.best_of or body.n) > body.n:
        raise ApiError(400, "best_of > n cannot be streamed: the best choices are known only at the end",
                       param="best_of", code="unsupported")
    check_logit_bias(body, tok)


def _choices_param(body: CompletionRequest) -> str:
    """The field to blame when the choices cannot be held."""
    return "best_of" if (body.best_of or 0) > body.n else ("n" if body.n > 1 else "prompt")


async def _prompt_ids(body: CompletionRequest, tok, limit: int) -> list[list[int]]:
    """Token ids of each prompt: every prompt checked first (strings by their bytes, ids by their
    count, then against the vocabulary: a 422 names the prompt and the position of the first
    bad id), then the strings tokenised together off the event loop."""
    many = len(body.prompts) > 1 or not (isinstance(body.prompt, str) or isinstance(body.prompt[0], int))
    fields = [f"prompt.{k}" if many else "prompt" for k in range(len(body.prompts))]
    limit_name = "ATTNLENS_MAX_PROMPT_TOKENS"
    for field, p in zip(fields, body.prompts):  # every prompt checked before any is tokenised
        if isinstance(p, str):
            check_text_bytes(tok, p, limit, field=field, limit_name=limit_name)
        else:
            check_token_ids(tok, p, field=field, limit=limit, limit_name=limit_name)
    encoded = iter(await tokenize_texts(tok, [p for p in body.prompts if isinstance(p, str)], prompt=True))
    return [next(encoded) if isinstance(p, str) else list(p) for p in body.prompts]


def _generation_params(body: CompletionRequest, prompts_ids: list[list[int]],
                       served: ServedModel) -> list[GenerationParams]:
    """One generation per prompt and candidate (len(prompts) x (best_of or n)), in choice order."""
    jobs = []
    for ids in prompts_ids:
        for k in range(body.best_of or body.n):
            jobs.append(GenerationParams(
                prompt_ids=ids,
                max_new_tokens=body.max_tokens,
                sampling=sampling(body, k, served),
                stop=stop_strings(body),
                n_logprobs=body.logprobs or 0,
                prompt_logprobs=(body.logprobs or 0) if (body.echo and body.logprobs is not None) else None,
            ))
    return jobs


def _logprob_per_token(out, generation: RequestState) -> float:
    """best_of's ranking: the mean log-probability of a candidate's tokens (a final EOS included)."""
    lps = [t.logprob for t in out.tokens] + ([generation.eos_token.logprob] if generation.eos_token else [])
    return sum(lps) / len(lps) if lps else float("-inf")


class _CompletionChunks:
    """The legacy stream's chunks: a Completion whose one choice carries the new text (a ChunkWriter)."""

    def __init__(self, cid: str, created: int, name: str, choices: list[Choice], generations: list[RequestState],
                 echo: bool, prompt_tokens: int):
        self.head = {"id": cid, "object": "text_completion", "created": created, "model": name}
        self.choices, self.generations, self.echo, self.prompt_tokens = choices, generations, echo, prompt_tokens

    def _chunk(self, index: int, text: str, logprobs, finish_reason) -> str:
        return sse(None, {**self.head, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                                    "finish_reason": finish_reason}]})

    def first(self) -> str:  # an echo sends the prompts first
        return "".join(self._chunk(c.index, c.text, None, None) for c in self.choices) if self.echo else ""

    def token(self, index: int, event: StreamToken) -> str:
        return self._chunk(index, event.delta, self.choices[index].add_token(event), None)

    def done(self, index: int, event: StreamDone) -> str:
        frag = self.choices[index].add_end(event.delta, scored_token(self.generations[index].eos_token))
        return self._chunk(index, event.delta, frag, FINISH[event.finish_reason])

    def usage(self, completion_tokens: int) -> str:
        return sse(None, {**self.head, "choices": [], "usage": usage(self.prompt_tokens, completion_tokens)})


class CompletionsServing:
    """Answers POST /v1/completions for the models in `state`."""

    def __init__(self, state: AppState):
        self.state = state

    async def create(self, body: CompletionRequest, served: ServedModel, request: Request):
        """`served` (a model /v1 lists, found by the route's dependency) completes each prompt."""
        state = self.state
        engine: EngineFront = served.runner
        settings = state.settings
        check_new_token_limit(settings, body.max_tokens, "max_tokens")
        tok = engine.tokenizer
        _check_options(body, tok)
        check_capacity(engine, len(body.prompts), body.best_of or body.n, _choices_param(body))
        prompts_ids = await _prompt_ids(body, tok, settings.prompt_limit)
        # the text each prompt echoes: as sent, or the ids' text
        prompts = [p if isinstance(p, str) else tok.decode(p) for p in body.prompts]
        generation = served.generation
        for ids in prompts_ids:
            check_lengths(engine.config.context_length, settings, ids, body.max_tokens, generation,
                          max_field="max_tokens")
        if not generation.scores_prompt and body.echo and body.logprobs is not None:
            raise ApiError(400, f"echo with logprobs scores the prompt's tokens, but {served.describe()} reads its "
                                f"prompt as a source rather than predicting it: leave out echo or logprobs",
                           param="echo", code="unsupported")
        # all choices or none: a 429 never leaves part of them running; more than can ever fit is a 400
        candidates = body.best_of or body.n
        generations = engine.submit_all(_generation_params(body, prompts_ids, served), param=_choices_param(body))
        want_lp = body.logprobs is not None
        cid, created, name = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time()), served.name
        prompt_tokens = sum(len(ids) for ids in prompts_ids)
        metrics = state.metrics

        if body.stream:
            choices = [Choice(i, prompts[i // body.n], want_lp, body.echo, tok, body.logprobs or 0)
                       for i in range(len(generations))]
            chunks = _CompletionChunks(cid, created, name, choices, generations, body.echo, prompt_tokens)
            return stream_choices(generations, metrics, chunks, include_usage=include_usage(body))

        outcomes = await collect_choices(request, generations, metrics)
        result = []
        for p in range(len(prompts)):  # each prompt's candidates: all n of them, or the n best of best_of
            picked = list(range(p * candidates, (p + 1) * candidates))
            if candidates > body.n:
                picked = sorted(picked, key=lambda j: -_logprob_per_token(outcomes[j], generations[j]))[: body.n]
            for rank, j in enumerate(picked):
                g, out = generations[j], outcomes[j]
                c = Choice(p * body.n + rank, prompts[p], want_lp, body.echo, tok, body.logprobs or 0)
                if g.prompt_scores is not None:
                    c.add_prompt_scores(g.prompt_scores)
                for t in out.tokens:
                    c.add_token(t)
                c.add_end(out.done.delta, scored_token(g.eos_token))
                result.append(c.as_dict(out.done.finish_reason))
        completion_tokens = sum(o.done.usage.completion_tokens for o in outcomes)  # every candidate's
        return {"id": cid, "object": "text_completion", "created": created, "model": name, "choices": result,
                "usage": usage(prompt_tokens, completion_tokens)}
