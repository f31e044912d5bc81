"""POST /v1/completions' serving side (app/api/openai_routes.py is the thin router): OpenAI's
legacy completions.

The request's options checked (`suffix` is refused; `best_of` >= `n`, and not streamed when it
is larger), its prompts counted before any is tokenised (prompts x choices that could never fit
in the server's places are a 400 at once), every prompt checked (strings by their bytes, ids by
their count and vocabulary) and the strings tokenised together on a worker thread that lets go of
the GIL; then one generation per prompt and candidate, all admitted at once or none, and their
events as one Completion (the `n` best of `best_of` by log-probability per token) or as OpenAI's
stream of chunks (openai_serving.py runs the choices; here is how a choice and a chunk look).
"""

from __future__ import annotations

import codecs
import time
import uuid

from fastapi import Request

from attnlens.app.api.generate_schemas import GeneratedTokenOut, StreamDone, StreamToken
from attnlens.app.api.openai_schemas import CompletionRequest
from attnlens.app.engine import EngineFront, GenerationParams, RequestState
from attnlens.app.registry.model_registry import ServedModel
from attnlens.app.server.api_errors import ApiError
from attnlens.app.server.state import AppState
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
from attnlens.app.serving.prompts import check_text_bytes, check_token_ids, tokenize_texts
from attnlens.app.serving.request_limits import check_lengths, check_new_token_limit
from attnlens.app.serving.stream_events import scored_token


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
                stop=body.stops,
                n_logprobs=body.logprobs or 0,
                prompt_logprobs=(body.logprobs or 0) if (body.echo and body.logprobs is not None) else None,
            ))
    return jobs


def _logprob_per_token(out, generation: RequestState) -> float:
    """best_of's ranking: the mean log-probability of a candidate's tokens (a final EOS included)."""
    lps = [t.logprob for t in out.tokens] + ([generation.eos_token.logprob] if generation.eos_token else [])
    return sum(lps) / len(lps) if lps else float("-inf")


class _CompletionChunks:
    """The legacy stream's chunks: a Completion whose one choice carries the new text (openai_serving.ChunkWriter)."""

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
            return stream_choices(generations, metrics, chunks, include_usage=body.include_usage)

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
