"""attnlens.Client and attnlens.AsyncClient: the HTTP API from Python (httpx), with typed answers.

    import attnlens
    client = attnlens.Client("http://127.0.0.1:8000")          # api_key="..." when the server wants one
    answer = client.attention("To be, or not to be", layers=[0, 1])
    answer.maps.shape                                           # (2, heads, T, T), whatever the format
    for token in client.stream("ROMEO.", max_new_tokens=20):    # typed tokens as they arrive
        print(token.text, end="")

Every endpoint is written once, as a generator of requests (`_Call`s) that receives each answer's
JSON and returns the typed answer; Client drives it with blocking httpx calls, AsyncClient with
awaited ones, so both have the same methods (AsyncClient's are awaited): models, attention,
generate, stream, fill_mask, classify, embeddings, the explain routes heads (HeadAtlas), logits
(LogitsAnswer), lens (LensAnswer) and explain (HeadExplanation), and the causal routes patch
(PatchAnswer) and logit_attribution (LogitAttributionAnswer). Errors are exceptions
carrying the server's status, message, `param`, `code` and Retry-After (attnlens.errors).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, Union

import httpx

from .ablation import AblateSpec, ablate_body
from .answers import (
    Attention,
    Classification,
    Embeddings,
    FillMask,
    GeneratedToken,
    Generation,
    HeadAtlas,
    HeadExplanation,
    LensAnswer,
    LogitAttributionAnswer,
    LogitsAnswer,
    ModelSummary,
    PatchAnswer,
    StreamDone,
)
from .errors import APIConnectionError, APIError, StreamError, error_from_response

DEFAULT_URL = "http://127.0.0.1:8000"
Format = Literal["json", "f16", "u8"]
Packing = Literal["full", "tril"]
Probe = Union[bool, dict, tuple[int, int], None]


@dataclass(frozen=True)
class _Call:
    """One HTTP request an endpoint needs; the driver sends it and sends back the answer's JSON."""

    method: str
    path: str
    body: dict | None = None
    params: dict | None = None


Endpoint = Generator[_Call, Any, Any]  # yields requests, receives their JSON, returns the typed answer


def _given(**fields) -> dict:
    """The fields the caller gave (None = the server's default)."""
    return {k: v for k, v in fields.items() if v is not None}


def _listed(values) -> list | None:
    return None if values is None else list(values)


def _sender(sender: tuple | None) -> dict | None:
    """/patch's sender of (layer, head) or an encoder-decoder's (group, layer, head)."""
    if sender is None:
        return None
    *group, layer, head = sender
    return {"layer": int(layer), "head": int(head), **({"group": group[0]} if group else {})}


def _sequence(text: str | None, ids, messages, target: str | None, target_ids, model: str | None,
              ablate: AblateSpec) -> dict:
    """The fields every explain route reads its sequence from (as /attention does), and `ablate`."""
    return _given(model=model, text=text, ids=_listed(ids), messages=_listed(messages), target=target,
                  target_ids=_listed(target_ids), ablate=ablate_body(ablate))


def _probe_body(probe: Probe) -> dict | None:
    """/heads' `probe`: True (the default probe), (length, seed) or the field's dict as it is."""
    if probe is None or probe is False:
        return None
    if probe is True:
        return {"kind": "repeated_random"}
    if isinstance(probe, tuple):
        if len(probe) != 2:
            raise ValueError(f"probe: give (length, seed), not {probe!r}")
        return {"kind": "repeated_random", "length": probe[0], "seed": probe[1]}
    if isinstance(probe, dict):
        return {"kind": "repeated_random", **probe}
    raise TypeError(f"probe: True, (length, seed) or a dict, not {type(probe).__name__}")


class SSEParser:
    """Server-sent events a line at a time: feed() returns (event, data) when an event ends."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.data: list[str] = []

    def feed(self, line: str) -> tuple[str | None, str] | None:
        if line == "":
            event = (self.name, "\n".join(self.data)) if self.data else None
            self.name, self.data = None, []
            return event
        if line.startswith("event:"):
            self.name = line[len("event:"):].strip()
        elif line.startswith("data:"):
            self.data.append(line[len("data:"):].removeprefix(" "))
        return None


class _Endpoints:
    """The API's routes, each once; subclasses say how a _Call is sent (`_drive`)."""

    def __init__(self) -> None:
        self._families: dict[str | None, dict | None] = {}  # model name (None: the default) -> its family_info, from /models

    # --- what every route is ------------------------------------------------------------------
    def _models(self) -> Endpoint:
        body = yield _Call("GET", "/models")
        models = [ModelSummary.from_json(m) for m in body["models"]]
        self._families = {m.name: m.family_info for m in models}
        self._families[None] = self._families.get(body["default"])
        return models

    def _family(self, model: str | None) -> Endpoint:
        if model not in self._families:
            yield from self._models()
        return self._families.get(model)

    def _attention(self, text: str | None, ids: list[int] | None, model: str | None, layers, heads, format: str,
                   packing: str | None, target: str | None, target_ids: list[int] | None,
                   messages: list[dict] | None = None, ablate: AblateSpec = None, pool: int | None = None,
                   top_k: int | None = None, rows=None, cols=None) -> Endpoint:
        whole = pool is None and top_k is None and rows is None and cols is None
        if packing is None:  # the smaller packing the model allows: tril for whole maps where a group is causal
            packing = "full"
            if whole:
                family = yield from self._family(model)
                packing = "tril" if family and any(g["causal"] for g in family["groups"]) else "full"
        body = _given(model=model, text=text, ids=None if ids is None else list(ids),
                      layers=None if layers is None else list(layers), heads=None if heads is None else list(heads),
                      format=format, packing=packing, target=target,
                      target_ids=None if target_ids is None else list(target_ids),
                      messages=None if messages is None else list(messages), ablate=ablate_body(ablate),
                      pool=pool, top_k=top_k, rows=None if rows is None else list(rows),
                      cols=None if cols is None else list(cols))
        answer = yield _Call("POST", "/attention", body)
        return Attention.from_json(answer, text=text)

    def _generate(self, body: dict) -> Endpoint:
        answer = yield _Call("POST", "/generate", body)
        return Generation.from_json(answer)

    def _fill_mask(self, text: str, top_k: int | None, model: str | None) -> Endpoint:
        answer = yield _Call("POST", "/fill-mask", _given(model=model, text=text, top_k=top_k))
        return FillMask.from_json(answer, text)

    def _classify(self, text: str, model: str | None) -> Endpoint:
        answer = yield _Call("POST", "/classify", _given(model=model, text=text))
        return Classification.from_json(answer, text)

    def _model_info(self, model: str | None) -> Endpoint:
        return (yield _Call("GET", "/model", params=_given(model=model)))

    def _post(self, path: str, body: dict, answer_type) -> Endpoint:
        return answer_type.from_json((yield _Call("POST", path, body)))

    # --- the public methods (AsyncClient's return awaitables) -----------------------------------
    def models(self):
        """Every loaded model (GET /models): name, family, sizes, tasks, labels."""
        return self._drive(self._models())

    def model_info(self, model: str | None = None):
        """GET /model: the description of `model` (default: the server's default model), as a dict."""
        return self._drive(self._model_info(model))

    def attention(self, text: str | None = None, *, ids: list[int] | None = None, model: str | None = None,
                  layers: Iterable[int] | None = None, heads: Iterable[int] | None = None, format: Format = "json",
                  packing: Packing | None = None, target: str | None = None, target_ids: list[int] | None = None,
                  messages: list[dict] | None = None, ablate: AblateSpec = None, pool: int | None = None,
                  top_k: int | None = None, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None):
        """POST /attention: every map of `text` (or of token `ids` as they are, or of a chat model's
        conversation `messages`, [{"role", "content"}, ...], rendered by its template) -> Attention.

        `layers` / `heads` pick a subset (model indices); `format` is the transfer format (json:
        exact to 6 decimals, f16, u8: smaller), `packing` None picks the smaller one the model
        allows. Either way `.maps` is a float32 [layers][heads][query][key] array. An
        encoder-decoder takes `target` (or `target_ids`); without one it translates greedily.
        `ablate` gives the maps of the model with those heads ablated (as in every method that
        takes it: [{"layer", "head", "how", "group"}] dicts, attnlens.Ablation's, or the text
        form "2.2z,3.1m,cross:0.1z"; see attnlens.ablation); the answer echoes them.

        Long inputs: `pool=N` gives each map as an N x N grid of bins (each group's `row_edges`,
        `col_edges`), `top_k=K` each row's K heaviest keys (weights in `maps`, key positions in
        the group's `positions`), `rows=(a, b)` / `cols=(c, d)` a window at full resolution (or
        pooled, or top-k); each group's `query_range` / `key_range` say what it covers."""
        return self._drive(self._attention(text, ids, model, layers, heads, format, packing, target, target_ids,
                                           messages, ablate, pool, top_k, rows, cols))

    def generate(self, prompt: str | None = None, *, ids: list[int] | None = None, messages: list[dict] | None = None,
                 model: str | None = None,
                 max_new_tokens: int | None = None, temperature: float | None = None, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, stop: str | list[str] | None = None,
                 logprobs: int | None = None, return_attention: bool | None = None, ablate: AblateSpec = None):
        """POST /generate -> Generation (text, prompt_tokens, typed tokens, finish_reason, usage), of
        `prompt`, of token `ids` as they are, or of a chat model's conversation `messages` (its
        prompt_tokens: the rendered template's). Parameters left None take the server's defaults.
        `ablate`: generate with those heads ablated ("mean": over the prompt's positions); the
        answer echoes them."""
        return self._drive(self._generate(_generate_body(
            prompt, ids=_listed(ids), messages=messages, model=model, max_new_tokens=max_new_tokens, temperature=temperature,
            top_k=top_k, top_p=top_p, seed=seed, stop=stop, logprobs=logprobs, return_attention=return_attention,
            ablate=ablate)))

    def fill_mask(self, text: str, *, top_k: int | None = None, model: str | None = None):
        """POST /fill-mask (an encoder): the top-k candidates of each [MASK] -> FillMask."""
        return self._drive(self._fill_mask(text, top_k, model))

    def classify(self, text: str, *, model: str | None = None):
        """POST /classify (an encoder with labels): every label's probability -> Classification."""
        return self._drive(self._classify(text, model))

    def embeddings(self, input: str | Iterable[str], *, model: str | None = None):
        """POST /v1/embeddings (an encoder): each text's unit-length sentence embedding ->
        Embeddings, `.vectors` a (texts, width) float32 array (one row for one string)."""
        texts = input if isinstance(input, str) else list(input)
        body = _given(model=model, input=texts, encoding_format="base64")
        return self._drive(self._post("/v1/embeddings", body, Embeddings))

    # --- the explain routes: which heads do what, and whether they matter ------------------------
    def heads(self, text: str | None = None, *, ids: list[int] | None = None, probe: Probe = None,
              target: str | None = None, target_ids: list[int] | None = None, model: str | None = None):
        """POST /heads: every head of every attention group scored on `text`, token `ids` or the
        repeated-random `probe` (exactly one; probe=True: the default length, (length, seed), or
        the field's dict) -> HeadAtlas: `.scores[name]` [layers, heads] arrays, `.roles`,
        `.top("induction", 5)`, and per group `.groups[name]`. The translator takes `target`."""
        body = _given(model=model, text=text, ids=_listed(ids), probe=_probe_body(probe), target=target,
                      target_ids=_listed(target_ids))
        return self._drive(self._post("/heads", body, HeadAtlas))

    def logits(self, text: str | None = None, *, ids: list[int] | None = None, messages: list[dict] | None = None,
               target: str | None = None, target_ids: list[int] | None = None, model: str | None = None,
               top_k: int | None = None, positions: Literal["all", "last"] | None = None, ablate: AblateSpec = None):
        """POST /logits: at every position (or the "last") the top_k predicted tokens and the actual
        next token's probability -> LogitsAnswer. With `ablate`, the ablated model's, the `clean`
        run's and the `effect` (kl, delta_logprob arrays per position)."""
        body = {**_sequence(text, ids, messages, target, target_ids, model, ablate),
                **_given(top_k=top_k, positions=positions)}
        return self._drive(self._post("/logits", body, LogitsAnswer))

    def lens(self, text: str | None = None, *, ids: list[int] | None = None, messages: list[dict] | None = None,
             target: str | None = None, target_ids: list[int] | None = None, model: str | None = None,
             top_k: int | None = None, positions: list[int] | None = None, rank: bool | None = None,
             ablate: AblateSpec = None):
        """POST /lens, the logit lens: the residual stream at the embeddings and after every block
        through the final norm and the head, at every position or at `positions` (only those are
        computed) -> LensAnswer (`labels`, `columns`, `top1` grid, `prob`, `actual_prob` [rows, P],
        and with `rank=True` `actual_rank`)."""
        body = {**_sequence(text, ids, messages, target, target_ids, model, ablate),
                **_given(top_k=top_k, positions=positions, rank=rank)}
        return self._drive(self._post("/lens", body, LensAnswer))

    def explain(self, text: str | None = None, *, layer: int, head: int, query: int, group: str | None = None,
                ids: list[int] | None = None, messages: list[dict] | None = None, target: str | None = None,
                target_ids: list[int] | None = None, model: str | None = None, ablate: AblateSpec = None,
                key: int | None = None):
        """POST /attention/explain: head `head` of layer `layer` (in `group`, default the family's
        first) at query position `query`, step by step -> HeadExplanation (q, keys, values,
        scores, softmax, pattern_row, z as arrays; `.recompute()` does it again here). With `key`
        (a key position: 0..query for a causal head, a source position for the translator's
        encoder and cross heads; a pre-norm decoder or an encoder-decoder, no ablate) also
        `.score_parts`: why the head attends there, its score split into pairs of what wrote the
        two streams."""
        body = {**_sequence(text, ids, messages, target, target_ids, model, ablate),
                **_given(group=group, key=key), "layer": layer, "head": head, "query": query}
        return self._drive(self._post("/attention/explain", body, HeadExplanation))

    # --- the causal routes: which components carry a behaviour -------------------------------------
    def patch(self, clean: str | None = None, corrupted: str | None = None, *, answer: str | None = None,
              foil: str | None = None, clean_ids: list[int] | None = None, corrupted_ids: list[int] | None = None,
              answer_id: int | None = None, foil_id: int | None = None, position: int | None = None,
              component: Literal["heads", "heads_by_position", "residual", "layers", "paths"] | None = None,
              method: Literal["exact", "attribution"] | None = None, sender: tuple | None = None,
              target: str | None = None, target_ids: list[int] | None = None, model: str | None = None):
        """POST /patch (a decoder or an encoder-decoder): each cell of `component` (default "heads")
        patched from the `clean` prompt's run into the `corrupted` one's (as many tokens; or
        `clean_ids`, `corrupted_ids`), the metric logit(answer) - logit(foil) at `position` (default
        the last) -> PatchAnswer (`.values`, `.normalized`, `.top(k)`). `answer` / `foil`: one token's
        text each (or `answer_id` / `foil_id`). `method` "attribution": first-order estimates from one
        forward pair and one backward. `sender` (layer, head): the head of component "paths". An
        encoder-decoder's prompts are sources read with one `target` (or `target_ids`; default none),
        `position` a target position: values by group (encoder, decoder, cross); its sender is
        (group, layer, head), e.g. ("encoder", 0, 1), as its answers' top() name heads."""
        body = _given(model=model, clean=clean, clean_ids=_listed(clean_ids), corrupted=corrupted,
                      corrupted_ids=_listed(corrupted_ids), answer=answer, answer_id=answer_id, foil=foil,
                      foil_id=foil_id, target=target, target_ids=_listed(target_ids), position=position,
                      component=component, method=method,
                      sender=_sender(sender))
        return self._drive(self._post("/patch", body, PatchAnswer))

    def logit_attribution(self, text: str | None = None, *, ids: list[int] | None = None, answer: str | None = None,
                          foil: str | None = None, answer_id: int | None = None, foil_id: int | None = None,
                          position: int | None = None, target: str | None = None, target_ids: list[int] | None = None,
                          model: str | None = None):
        """POST /logit-attribution (a pre-norm decoder or an encoder-decoder): each head's, MLP's, the
        embedding's and the rest's direct write into logit(answer) - logit(foil) at `position` (default
        the last; answer and foil default to the top two predictions there) -> LogitAttributionAnswer
        (`.heads` [L, H], `.mlps` [L], `.top(k)`; the parts sum to `.logit_difference`). An
        encoder-decoder's `text` is its source, read with `target` (or `target_ids`): `.heads`
        {"decoder", "cross"}."""
        body = _given(model=model, text=text, ids=_listed(ids), answer=answer, answer_id=answer_id, foil=foil,
                      foil_id=foil_id, target=target, target_ids=_listed(target_ids), position=position)
        return self._drive(self._post("/logit-attribution", body, LogitAttributionAnswer))

    def _drive(self, endpoint: Endpoint):
        raise NotImplementedError


def _generate_body(prompt: str | None, **options) -> dict:
    """/generate's body: the prompt (or `messages`) and the options given (a lone stop string as a
    list, `ablate` in any of its forms as the list of dicts)."""
    stop = options.get("stop")
    if isinstance(stop, str):
        options["stop"] = [stop]
    if "ablate" in options:
        options["ablate"] = ablate_body(options["ablate"])
    return _given(prompt=prompt, **options)


def _headers(api_key: str | None, extra: dict[str, str] | None) -> dict[str, str]:
    headers = {"Accept": "application/json", "User-Agent": "attnlens-python"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return {**headers, **(extra or {})}


def _checked(response: httpx.Response) -> Any:
    if response.status_code >= 400:
        raise error_from_response(response)
    try:
        return response.json()
    except ValueError as e:
        raise APIError(f"the server's answer is not JSON: {response.text[:200]!r}", status=response.status_code) \
            from e


def _stream_event(name: str | None, data: str) -> GeneratedToken | StreamDone:
    body = json.loads(data)
    if name == "token":
        return GeneratedToken.from_json(body)
    if name == "done":
        return StreamDone.from_json(body)
    if name == "error":
        raise StreamError(body.get("message", data))
    raise StreamError(f"unexpected stream event {name!r}: {data[:200]}")


class Client(_Endpoints):
    """A blocking client: `Client(base_url, api_key=None)`. Use it as a context manager, or close()."""

    def __init__(self, base_url: str = DEFAULT_URL, api_key: str | None = None, *, timeout: float = 120.0,
                 headers: dict[str, str] | None = None, transport: httpx.BaseTransport | None = None):
        super().__init__()
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, headers=_headers(api_key, headers), timeout=timeout,
                                  transport=transport)

    def _send(self, call: _Call) -> Any:
        try:
            response = self._http.request(call.method, call.path, json=call.body, params=call.params)
        except httpx.TransportError as e:
            raise APIConnectionError(f"cannot reach attnlens at {self.base_url}: {e}") from e
        return _checked(response)

    def _drive(self, endpoint: Endpoint):
        try:
            call = next(endpoint)
            while True:
                call = endpoint.send(self._send(call))
        except StopIteration as done:
            return done.value

    def stream(self, prompt: str | None = None, **options) -> TokenStream:
        """POST /generate with stream=true: iterate it for GeneratedToken's as they arrive (with
        `index` and `delta`); afterwards `.done` is the StreamDone. Options as generate()'s."""
        return TokenStream(self, {**_generate_body(prompt, **options), "stream": True})

    def ready(self) -> bool:
        """Whether /readyz answers 200 (models loaded and warmed up)."""
        try:
            return self._http.get("/readyz").status_code == 200
        except httpx.TransportError:
            return False

    def wait_until_ready(self, timeout: float = 120.0, interval: float = 0.25, stop_if=None) -> None:
        """Block until the server is ready (e.g. one just started), or raise APIConnectionError
        after `timeout` seconds or as soon as `stop_if()` is true (e.g. its process ended)."""
        deadline = time.monotonic() + timeout
        while not self.ready():
            if stop_if is not None and stop_if():
                raise APIConnectionError(f"attnlens at {self.base_url} stopped before it was ready")
            if time.monotonic() > deadline:
                raise APIConnectionError(f"attnlens at {self.base_url} not ready after {timeout} s")
            time.sleep(interval)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"attnlens.Client({self.base_url!r})"


class TokenStream:
    """A generation arriving token by token: iterate it (once) for GeneratedToken's; `.tokens`
    and `.text` so far, `.done` (StreamDone) once it ended. close() (or leaving a `with`
    block) stops it: the server then frees the generation's slot."""

    def __init__(self, client: Client, body: dict):
        self._client, self._body = client, body
        self._response: httpx.Response | None = None
        self.tokens: list[GeneratedToken] = []
        self.done: StreamDone | None = None

    @property
    def text(self) -> str:
        return self.done.text if self.done else "".join(t.delta or "" for t in self.tokens)

    def __iter__(self) -> Iterator[GeneratedToken]:
        http = self._client._http
        try:
            with http.stream("POST", "/generate", json=self._body,
                             headers={"Accept": "text/event-stream"}) as response:
                self._response = response
                if response.status_code >= 400:
                    response.read()
                    raise error_from_response(response)
                parser = SSEParser()
                for line in response.iter_lines():
                    if (ended := parser.feed(line)) is None:
                        continue
                    event = _stream_event(*ended)
                    if isinstance(event, StreamDone):
                        self.done = event
                        return
                    self.tokens.append(event)
                    yield event
        except httpx.TransportError as e:
            raise APIConnectionError(f"the stream from {self._client.base_url} broke: {e}") from e
        finally:
            self._response = None
        raise StreamError("the stream ended without its `done` event")

    def close(self) -> None:
        if self._response is not None:
            self._response.close()

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(_Endpoints):
    """The async twin of Client: the same methods, awaited; `stream()` is an async iterator."""

    def __init__(self, base_url: str = DEFAULT_URL, api_key: str | None = None, *, timeout: float = 120.0,
                 headers: dict[str, str] | None = None, transport: httpx.AsyncBaseTransport | None = None):
        super().__init__()
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=_headers(api_key, headers), timeout=timeout,
                                       transport=transport)

    async def _send(self, call: _Call) -> Any:
        try:
            response = await self._http.request(call.method, call.path, json=call.body, params=call.params)
        except httpx.TransportError as e:
            raise APIConnectionError(f"cannot reach attnlens at {self.base_url}: {e}") from e
        return _checked(response)

    async def _drive(self, endpoint: Endpoint):
        try:
            call = next(endpoint)
            while True:
                call = endpoint.send(await self._send(call))
        except StopIteration as done:
            return done.value

    async def stream(self, prompt: str | None = None, **options) -> AsyncIterator[GeneratedToken]:
        """POST /generate with stream=true, as an async iterator of GeneratedToken's (the last
        event, StreamDone, ends it; use Client.stream for `.done`). Options as generate()'s."""
        body = {**_generate_body(prompt, **options), "stream": True}
        try:
            async with self._http.stream("POST", "/generate", json=body,
                                         headers={"Accept": "text/event-stream"}) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise error_from_response(response)
                parser = SSEParser()
                async for line in response.aiter_lines():
                    if (ended := parser.feed(line)) is None:
                        continue
                    event = _stream_event(*ended)
                    if isinstance(event, StreamDone):
                        return
                    yield event
        except httpx.TransportError as e:
            raise APIConnectionError(f"the stream from {self.base_url} broke: {e}") from e
        raise StreamError("the stream ended without its `done` event")

    async def ready(self) -> bool:
        try:
            return (await self._http.get("/readyz")).status_code == 200
        except httpx.TransportError:
            return False

    async def wait_until_ready(self, timeout: float = 120.0, interval: float = 0.25, stop_if=None) -> None:
        deadline = time.monotonic() + timeout
        while not await self.ready():
            if stop_if is not None and stop_if():
                raise APIConnectionError(f"attnlens at {self.base_url} stopped before it was ready")
            if time.monotonic() > deadline:
                raise APIConnectionError(f"attnlens at {self.base_url} not ready after {timeout} s")
            await asyncio.sleep(interval)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"attnlens.AsyncClient({self.base_url!r})"
