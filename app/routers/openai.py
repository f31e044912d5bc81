"""OpenAI-compatible legacy completions: POST /v1/completions, GET /v1/models and
GET /v1/models/{model}.

`model` names one of the loaded models that generate (GET /v1/models; none = the default
model); an unknown name is a 404 `model_not_found` listing those, an encoder a 400.
`logit_bias`, `presence_penalty` and `frequency_penalty` act as in vLLM (per choice, over the
tokens that choice generated; log-probabilities stay the model's own); `best_of` generates
that many choices per prompt and returns the `n` with the highest log-probability per token;
`suffix` is refused (400). Differences from OpenAI, on purpose: `n` (or `best_of`) > 1 with a
seed uses seed, seed + 1, ... for the choices so they differ yet repeat; a streamed `echo`
sends the prompt text first but no logprobs for the prompt tokens.

A list of prompts is counted before any is tokenised (prompts x choices that could never fit
in the server's places are a 400 at once), and the strings are tokenised together on a
worker thread that lets go of the GIL.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from attnlens.model import SamplingParams

from ..deps import get_state
from ..engine import EngineFront, GenerationParams, RequestState, RequestTooLarge
from ..errors import ApiError, public_message
from ..request_limits import check_lengths, check_new_token_limit
from ..schemas import GeneratedTokenOut, StreamDone, StreamToken
from ..serving import SSE_HEADERS, cancel_on_disconnect, collect, note_unfinished, sse
from ..stream_events import events as request_events, scored_token
from ..openai_schemas import Completion, CompletionRequest, ModelCard, ModelList, OpenAIErrorResponse
from ..prompts import check_text_bytes, check_token_ids, tokenize_texts
from ..registry import COMPLETIONS, ServedModel, lookup
from ..state import AppState

log = logging.getLogger("attnlens.routers")

router = APIRouter(prefix="/v1", tags=["openai"])

ERRORS = {code: {"model": OpenAIErrorResponse} for code in (400, 401, 404, 408, 413, 422, 429, 503)}
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


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
        self.lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
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
        frag = {"tokens": [text], "token_logprobs": [logprob], "top_logprobs": [top], "text_offset": [self.offset]}
        for k, v in frag.items():
            self.lp[k].extend(v)
        return frag

    def as_dict(self, finish_reason: str) -> dict:
        return {"index": self.index, "text": self.text, "logprobs": self.lp if self.want_logprobs else None,
                "finish_reason": FINISH[finish_reason]}


def _not_found(state: AppState, name: str) -> ApiError:
    """OpenAI's 404 for a model: it names only the models GET /v1/models lists."""
    listed = [m.name for m in state.registry.models.values() if COMPLETIONS in m.tasks]
    return ApiError(404, f"the model {name!r} does not exist; the models here are: {', '.join(listed)} "
                         f"(GET /v1/models)", param="model", code="model_not_found")


def _lookup(state: AppState, name: str | None) -> ServedModel:
    """The model a /v1 request names: a 404 for a name no loaded model has (naming the /v1
    models); a loaded model that cannot complete is a 400 that says what it can do."""
    if name is not None and state.ready and state.registry is not None and name not in state.registry.models:
        raise _not_found(state, name)
    return lookup(state, name, COMPLETIONS)


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
    for key in body.logit_bias or {}:
        if int(key) >= tok.vocab_size:
            raise ApiError(400, f"logit_bias names token {key}, which is not in the vocabulary: ids run "
                                f"0..{tok.vocab_size - 1}", param="logit_bias", code="invalid_value")


def _count(body: CompletionRequest, engine: EngineFront) -> None:
    """Prompts x choices the server can never hold at once: a 400 before anything is tokenised."""
    needed = len(body.prompts) * (body.best_of or body.n)
    capacity = engine.max_concurrent + engine.max_queue
    if needed > capacity:
        param = "best_of" if (body.best_of or 0) > body.n else ("n" if body.n > 1 else "prompt")
        raise RequestTooLarge(
            f"this request needs {needed} generations at once ({len(body.prompts)} prompt(s) x "
            f"{body.best_of or body.n} choices), more than the server can ever hold: {engine.max_concurrent} "
            f"running + {engine.max_queue} waiting (ATTNLENS_MAX_CONCURRENT + ATTNLENS_MAX_QUEUE); send fewer "
            "prompts or fewer choices per request", param=param)


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


def _generation_params(body: CompletionRequest, prompts_ids: list[list[int]]) -> list[GenerationParams]:
    """One generation per prompt and candidate (len(prompts) x (best_of or n)), in choice order."""
    bias = {int(k): v for k, v in body.logit_bias.items()} if body.logit_bias else None
    jobs = []
    for ids in prompts_ids:
        for k in range(body.best_of or body.n):
            seed = None if body.seed is None else (body.seed + k) % 2**63
            jobs.append(GenerationParams(
                prompt_ids=ids,
                max_new_tokens=body.max_tokens,
                sampling=SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, seed=seed,
                                        logit_bias=bias, presence_penalty=body.presence_penalty,
                                        frequency_penalty=body.frequency_penalty),
                stop=body.stops,
                n_logprobs=body.logprobs or 0,
                prompt_logprobs=(body.logprobs or 0) if (body.echo and body.logprobs is not None) else None,
            ))
    return jobs


def _logprob_per_token(out, generation: RequestState) -> float:
    """best_of's ranking: the mean log-probability of a candidate's tokens (a final EOS included)."""
    lps = [t.logprob for t in out.tokens] + ([generation.eos_token.logprob] if generation.eos_token else [])
    return sum(lps) / len(lps) if lps else float("-inf")


STREAM = {"description": "a Completion, or with stream=true OpenAI's stream: `data:` events each holding a JSON "
                         "chunk (a Completion whose choices carry the new text), or an `error` object, then "
                         "`data: [DONE]`",
          "content": {"text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {
              "data": {"type": "string", "description": "a JSON Completion chunk, an error object, or [DONE]"}}}}}}


@router.post("/completions", response_model=Completion, response_model_exclude_none=False,
             responses={**ERRORS, 200: STREAM})
async def completions(body: CompletionRequest, request: Request, state: AppState = Depends(get_state)):
    served = _lookup(state, body.model)
    engine: EngineFront = served.runner
    settings = state.settings
    check_new_token_limit(settings, body.max_tokens, "max_tokens")
    tok = engine.tokenizer
    _check_options(body, tok)
    _count(body, engine)
    prompts_ids = await _prompt_ids(body, tok, settings.max_prompt_tokens)
    # the text each prompt echoes: as sent, or the ids' text
    prompts = [p if isinstance(p, str) else tok.decode(p) for p in body.prompts]
    generation = served.family.generation
    for ids in prompts_ids:
        check_lengths(engine.config.context_length, settings, ids, body.max_tokens, generation,
                      max_field="max_tokens")
    if not generation.scores_prompt and body.echo and body.logprobs is not None:
        raise ApiError(400, f"echo with logprobs scores the prompt's tokens, but {served.describe()} reads its "
                            f"prompt as a source rather than predicting it: leave out echo or logprobs",
                       param="echo", code="unsupported")
    # all choices or none: a 429 never leaves part of them running; more than can ever fit is a 400
    candidates = body.best_of or body.n
    generations = engine.submit_all(_generation_params(body, prompts_ids),
                                    param="best_of" if candidates > body.n else ("n" if body.n > 1 else "prompt"))
    want_lp = body.logprobs is not None
    cid, created, name = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time()), served.name
    prompt_tokens = sum(len(ids) for ids in prompts_ids)
    metrics = state.metrics

    if body.stream:
        choices = [Choice(i, prompts[i // body.n], want_lp, body.echo, tok, body.logprobs or 0)
                   for i in range(len(generations))]
        include_usage = bool((body.stream_options or {}).get("include_usage"))

        def chunk(index: int, text: str, logprobs, finish_reason) -> str:
            return sse(None, {"id": cid, "object": "text_completion", "created": created, "model": name,
                              "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                           "finish_reason": finish_reason}]})

        async def events():
            merged: asyncio.Queue = asyncio.Queue()

            async def forward(i: int, g: RequestState):
                async for ev in request_events(g):
                    await merged.put((i, ev))

            tasks = [asyncio.create_task(forward(i, g)) for i, g in enumerate(generations)]
            completion_tokens, ended = 0, 0
            try:
                if body.echo:
                    for c in choices:
                        yield chunk(c.index, c.text, None, None)
                remaining = len(generations)
                while remaining:
                    waiting = [await merged.get()]  # and every event already waiting: one write
                    while not merged.empty():
                        waiting.append(merged.get_nowait())
                    out = []
                    for i, ev in waiting:
                        c = choices[i]
                        if isinstance(ev, StreamToken):
                            out.append(chunk(i, ev.delta, c.add_token(ev), None))
                        elif isinstance(ev, StreamDone):
                            remaining -= 1
                            ended += 1
                            completion_tokens += ev.usage.completion_tokens
                            metrics.observe_generation(ev)
                            frag = c.add_end(ev.delta, scored_token(generations[i].eos_token))
                            out.append(chunk(i, ev.delta, frag, FINISH[ev.finish_reason]))
                        else:
                            ended += 1
                            note_unfinished(metrics, "error")
                            out.append(sse(None, {"error": {"message": public_message(ev.message),
                                                            "type": "server_error", "param": None,
                                                            "code": ev.code or "generation_failed"}}))
                            yield "".join(out)
                            return
                    yield "".join(out)
                if include_usage:
                    yield sse(None, {"id": cid, "object": "text_completion", "created": created, "model": name,
                                     "choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                                              "completion_tokens": completion_tokens,
                                                              "total_tokens": prompt_tokens + completion_tokens}})
                yield "data: [DONE]\n\n"
            except Exception:
                log.exception("stream failed")
                yield sse(None, {"error": {"message": "internal error (see the server log)", "type": "server_error",
                                           "param": None, "code": "internal_error"}})
            finally:
                note_unfinished(metrics, "cancelled", len(generations) - ended)  # their client went away
                for t in tasks:
                    t.cancel()
                for g in generations:
                    g.cancel()

        return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)

    async with cancel_on_disconnect(request, generations):
        outcomes = await asyncio.gather(*(collect(g, metrics) for g in generations))
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
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def _card(served: ServedModel) -> dict:
    path = served.path
    created = int(path.stat().st_mtime) if path is not None and path.exists() else 0
    return {"id": served.name, "object": "model", "created": created, "owned_by": "attnlens"}


@router.get("/models", response_model=ModelList, responses=ERRORS)
async def models(state: AppState = Depends(get_state)):
    """The models that generate (decoders, encoder-decoders); GET /models lists every loaded model."""
    lookup(state, None, None)  # 503 until the models are ready
    registry = state.registry
    return {"object": "list", "data": [_card(m) for m in registry.models.values() if COMPLETIONS in m.tasks]}


@router.get("/models/{model}", response_model=ModelCard, responses=ERRORS)
async def model_card(model: str, state: AppState = Depends(get_state)):
    """One model of GET /v1/models (OpenAI's models.retrieve); a model /v1 cannot use is a 404."""
    lookup(state, None, None)  # 503 until the models are ready
    served = state.registry.models.get(model)
    if served is None or COMPLETIONS not in served.tasks:
        raise _not_found(state, model)
    return _card(served)
