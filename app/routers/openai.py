"""OpenAI-compatible legacy completions: POST /v1/completions and GET /v1/models.

`model` names one of the loaded decoders (GET /v1/models; none = the default model); an
unknown name is a 404 `model_not_found` listing the loaded ones, an encoder a 400.
Differences from OpenAI, on purpose: `n` > 1 with a seed uses seed, seed + 1, ... for the
choices so they differ yet repeat; penalties, best_of, logit_bias and suffix are accepted
and ignored; a streamed `echo` sends the prompt text first but no logprobs for the prompt
tokens.
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

from ..deps import RegistryDep, get_state
from ..engine import EngineFront, Generation, GenerationParams
from ..errors import ApiError, public_message
from ..request_limits import check_lengths, check_new_token_limit
from ..schemas import GeneratedTokenOut, StreamDone, StreamToken
from ..serving import SSE_HEADERS, cancel_on_disconnect, collect, sse
from ..openai_schemas import Completion, CompletionRequest, ModelList, OpenAIErrorResponse
from ..prompts import check_text_bytes, check_token_ids, tokenize_text
from ..registry import COMPLETIONS, lookup
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


async def _prompt_ids(body: CompletionRequest, tok, limit: int) -> list[list[int]]:
    """Token ids of each prompt: strings tokenised (off the event loop), ids checked against the
    vocabulary (a 422 names the prompt and the position of the first bad id)."""
    many = len(body.prompts) > 1 or not (isinstance(body.prompt, str) or isinstance(body.prompt[0], int))
    fields = [f"prompt.{k}" if many else "prompt" for k in range(len(body.prompts))]
    limit_name = "ATTNLENS_MAX_PROMPT_TOKENS"
    for field, p in zip(fields, body.prompts):  # every prompt checked before any is tokenised
        if isinstance(p, str):
            check_text_bytes(tok, p, limit, field=field, limit_name=limit_name)
        else:
            check_token_ids(tok, p, field=field)
    return [await tokenize_text(tok, p, limit, field=field, limit_name=limit_name) if isinstance(p, str) else list(p)
            for field, p in zip(fields, body.prompts)]


def _generation_params(body: CompletionRequest, prompts_ids: list[list[int]]) -> list[GenerationParams]:
    """One generation per prompt and choice (len(prompts) x n), in choice order."""
    jobs = []
    for ids in prompts_ids:
        for k in range(body.n):
            seed = None if body.seed is None else (body.seed + k) % 2**63
            jobs.append(GenerationParams(
                prompt_ids=ids,
                max_new_tokens=body.max_tokens,
                sampling=SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, seed=seed),
                stop=body.stops,
                n_logprobs=body.logprobs or 0,
                prompt_logprobs=(body.logprobs or 0) if (body.echo and body.logprobs is not None) else None,
            ))
    return jobs


@router.post("/completions", response_model=Completion, response_model_exclude_none=False, responses=ERRORS)
async def completions(body: CompletionRequest, request: Request, state: AppState = Depends(get_state)):
    served = lookup(state, body.model, COMPLETIONS)
    engine: EngineFront = served.runner
    settings = state.settings
    check_new_token_limit(settings, body.max_tokens, "max_tokens")
    tok = engine.tokenizer
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
    generations = engine.submit_all(_generation_params(body, prompts_ids), param="n" if body.n > 1 else "prompt")
    want_lp = body.logprobs is not None
    choices = [Choice(i, prompts[i // body.n], want_lp, body.echo, tok, body.logprobs or 0)
               for i in range(len(generations))]
    cid, created, name = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time()), served.name
    prompt_tokens = sum(len(ids) for ids in prompts_ids)
    metrics = state.metrics

    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))

        def chunk(index: int, text: str, logprobs, finish_reason) -> str:
            return sse(None, {"id": cid, "object": "text_completion", "created": created, "model": name,
                              "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                           "finish_reason": finish_reason}]})

        async def events():
            merged: asyncio.Queue = asyncio.Queue()

            async def forward(i: int, g: Generation):
                async for ev in g.events():
                    await merged.put((i, ev))

            tasks = [asyncio.create_task(forward(i, g)) for i, g in enumerate(generations)]
            completion_tokens = 0
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
                            completion_tokens += ev.usage.completion_tokens
                            metrics.observe_generation(ev)
                            frag = c.add_end(ev.delta, generations[i].eos_token)
                            out.append(chunk(i, ev.delta, frag, FINISH[ev.finish_reason]))
                        else:
                            out.append(sse(None, {"error": {"message": public_message(ev.message),
                                                            "type": "server_error", "param": None,
                                                            "code": "generation_failed"}}))
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
                for t in tasks:
                    t.cancel()
                for g in generations:
                    g.cancel()

        return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)

    async with cancel_on_disconnect(request, generations):
        outcomes = await asyncio.gather(*(collect(g, metrics) for g in generations))
    result = []
    for c, g, out in zip(choices, generations, outcomes):
        if g.prompt_scores is not None:
            c.add_prompt_scores(g.prompt_scores)
        for t in out.tokens:
            c.add_token(t)
        c.add_end(out.done.delta, g.eos_token)
        result.append(c.as_dict(out.done.finish_reason))
    completion_tokens = sum(o.done.usage.completion_tokens for o in outcomes)
    return {"id": cid, "object": "text_completion", "created": created, "model": name, "choices": result,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


@router.get("/models", response_model=ModelList)
async def models(registry: RegistryDep):
    """The models that generate (decoders); GET /models lists every loaded model."""
    data = []
    for served in registry.models.values():
        if COMPLETIONS not in served.tasks:
            continue
        path = served.path
        created = int(path.stat().st_mtime) if path is not None and path.exists() else 0
        data.append({"id": served.name, "object": "model", "created": created, "owned_by": "attnlens"})
    return {"object": "list", "data": data}
