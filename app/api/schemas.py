"""Request and response bodies of the native API (/generate, /attention, /model, ...)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator


def _utf8_text(value: str) -> str:
    """JSON can carry a lone surrogate ("\\ud800"); it is no text and cannot be tokenised."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode: a lone surrogate U+{ord(value[e.start]):04X} at character "
                         f"{e.start}") from None
    return value


Text = Annotated[str, AfterValidator(_utf8_text)]
"""A str that is valid Unicode (encodes to UTF-8): what every text field of a request is."""
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_utf8_text)]
"""A Text that is not "" (e.g. one item of a list of texts)."""


class Strict(BaseModel):
    """Unknown fields are an error (422), so a misspelt option is never silently ignored; types
    are strict, so `"4"` or `true` is no integer and `"yes"` no boolean."""

    model_config = ConfigDict(extra="forbid", strict=True, ser_json_inf_nan="constants")


# --- fields every request shares ------------------------------------------------
MODEL_FIELD = "a loaded model's name (GET /models); default: the default model (for a task only one loaded " \
              "model can do, e.g. fill-mask, that model)"
ModelName = Annotated[str, Field(min_length=1, max_length=256), AfterValidator(_utf8_text)]
"""A `model` field: a loaded model's name; "" is no name (a 422), not the default model."""

MAX_STOPS = 4  # stop strings per request, as OpenAI allows
MAX_STOP_CHARS = 256  # characters in one stop string (matched on the text as it is generated)
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS), AfterValidator(_utf8_text)]
Stop = Annotated[StopText | list[StopText] | None, Field(
    description=f"a stop string, or a list of at most {MAX_STOPS} (each 1..{MAX_STOP_CHARS} characters): "
                      "generation ends where the text first holds one, which is left out of the answer")]


def count_stops(value: Any) -> Any:
    """Before the stop strings are validated one by one: at most MAX_STOPS of them (a list of a
    hundred thousand is refused at once, not after checking each)."""
    if isinstance(value, list) and len(value) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} stop strings (got {len(value)})")
    return value


def stop_list(value: str | list[str] | None) -> list[str]:
    """The stop strings of a request's `stop` (one string, a list, or none) as a list."""
    return [value] if isinstance(value, str) else list(value or [])


# --- ablation (a field of /generate, /attention and the explain routes) ---------
class Ablation(Strict):
    """One attention head to ablate (model/hooks.py): its output before the output projection (z)
    set to 0 ("zero") or to its mean over the sequence's positions ("mean"; on /generate, the
    prompt positions' mean, held for every generated token)."""

    layer: int = Field(description="0..n_layers-1")
    head: int = Field(description="0..n_heads-1")
    how: Literal["zero", "mean"] = "zero"
    group: str | None = Field(None, description="the attention group (GET /models lists a model's): null = the "
                              "family's first generating group (decoder and encoder: self; encoder-decoder: decoder)")


ABLATE_DESCRIPTION = ("heads to ablate, at most ATTNLENS_MAX_ABLATIONS (default 64), no head twice; the answer "
                      "echoes them with each group resolved")
Ablate = Annotated[list[Ablation] | None, Field(description=ABLATE_DESCRIPTION)]


# --- a conversation (/v1/chat/completions; /generate and /attention as `messages`) ------
MAX_CONTENT_PARTS = 64  # text parts in one message's content (OpenAI's list form)


class TextPart(Strict):
    """One part of a message's content in OpenAI's list form; only text (no images or audio)."""

    type: Literal["text"]
    text: Text


class ChatMessage(Strict):
    """One turn of a conversation. `content` is a string or a list of text parts (joined with
    "\\n", as vLLM joins them); tools and function calls are not supported (no `tool` role)."""

    role: Literal["system", "developer", "user", "assistant"] = Field(
        description="system, developer, user or assistant (passed to the template as it is)")
    content: Text | list[TextPart] = Field(description="the turn's text, or a list of text parts")
    name: Text | None = Field(None, max_length=256, description="passed to the template, which may use it")

    @field_validator("content")
    @classmethod
    def _parts(cls, v):
        if isinstance(v, list) and not 1 <= len(v) <= MAX_CONTENT_PARTS:
            raise ValueError(f"content as a list holds 1..{MAX_CONTENT_PARTS} text parts (got {len(v)})")
        return v

    def for_template(self) -> dict:
        """The message as transformers hands it to a chat template: a plain dict."""
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return {"role": self.role, "content": text, **({"name": self.name} if self.name is not None else {})}


Messages = Annotated[list[ChatMessage], Field(min_length=1, description=(
    "a conversation (OpenAI's messages) for a model with a chat template (GET /models lists `chat` in its "
    "tasks): rendered with the template, ending in the assistant's turn, and tokenised as transformers' "
    "apply_chat_template does; at most ATTNLENS_MAX_CHAT_MESSAGES messages"))]


# --- /generate ---------------------------------------------------------------
class GenerateRequest(Strict):
    """Give exactly one of `prompt` (text to continue), `ids` (token ids to continue, as they are) or
    `messages` (a conversation, for a chat model)."""

    model_config = ConfigDict(**Strict.model_config,
                              json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["ids"]},
                                                           {"required": ["messages"]}]})

    model: ModelName | None = Field(None, description=MODEL_FIELD)
    prompt: Text | None = Field(None, min_length=1, description="text to continue")
    ids: list[int] | None = Field(None, min_length=1, description="token ids to continue, as they are (nothing "
                                  "added: a model whose tokenizer adds BOS to a text gets none here); at most "
                                  "ATTNLENS_MAX_PROMPT_TOKENS")
    messages: Messages | None = None
    max_new_tokens: int = Field(64, ge=1, description="1..ATTNLENS_MAX_NEW_TOKENS")
    temperature: float = Field(0.8, ge=0, allow_inf_nan=False, description="0 = greedy")
    top_k: int | None = Field(None, ge=1)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=2**63, description="same seed and parameters, same text")
    stop: Stop = None
    logprobs: int = Field(0, ge=0, le=20, description="alternatives per token")
    stream: bool = False
    return_attention: bool = False
    ablate: Ablate = Field(None, description=ABLATE_DESCRIPTION + "; only this generation's row is edited (it "
                           "shares its decode batch with other requests)")

    _count_stops = field_validator("stop", mode="before")(count_stops)

    @field_validator("stop", mode="after")
    @classmethod
    def _stops(cls, v):
        return stop_list(v)  # always a list from here on


class TokenText(BaseModel):
    id: int
    text: str


class Alternative(TokenText):
    logprob: float


class GeneratedTokenOut(TokenText):
    logprob: float
    top_logprobs: list[Alternative] = []


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = Field(description="tokens the model generated, including a final EOS")
    total_tokens: int


class Timings(BaseModel):
    queue_ms: float
    prefill_ms: float
    decode_ms: float
    tokens_per_second: float
    time_to_first_token_ms: float


FinishReason = Literal["length", "stop", "eos"]


class GenerateResponse(BaseModel):
    id: str
    model: str
    text: str
    prompt_tokens: list[TokenText]
    tokens: list[GeneratedTokenOut]
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    attention: list[list[list[list[float]]]] | None = Field(
        None, description="[token][layer][head][position]: each generated token's attention row"
    )
    cross_attention: list[list[list[list[float]]]] | None = Field(
        None, description="encoder-decoder only, with return_attention: [token][layer][head][source position]: "
        "the cross-attention row over the source (the prompt's tokens) of the step that wrote each token"
    )
    ablate: list[Ablation] | None = Field(None, description="the request's ablations, groups resolved")


class StreamToken(GeneratedTokenOut):
    """`event: token` data when streaming."""

    index: int
    delta: str = Field(description="exact text this token adds (text joins these)")
    attention: list[list[list[float]]] | None = None
    cross_attention: list[list[list[float]]] | None = Field(
        None, description="encoder-decoder only: [layer][head][source position], this step's cross-attention "
        "row over the source (the prompt's tokens)")


class StreamDone(BaseModel):
    """`event: done` data when streaming."""

    id: str
    finish_reason: FinishReason
    prompt_tokens: list[TokenText] = Field(description="the prompt's tokens, as in the non-streamed answer: "
                                                       "their ids followed by the token events' ids are the "
                                                       "whole sequence (e.g. for /attention `ids`)")
    text: str = Field(description="the whole generated text")
    delta: str = Field(description="text no token event carried: usually empty, else a final partial "
                                   "character (U+FFFD); the token deltas plus this equal `text`")
    usage: Usage
    timings: Timings
    ablate: list[Ablation] | None = Field(None, description="the request's ablations, groups resolved")


class StreamError(BaseModel):
    """`event: error` data when streaming: the generation failed on the server."""

    message: str
    code: str | None = Field(None, description="why, e.g. engine_restarting (retry after `retry_after` s), "
                             "engine_failed, stream_backlog_exceeded, generation_failed")
    retry_after: int | None = Field(None, description="seconds after which the same request may succeed")


# --- /attention --------------------------------------------------------------
class AttentionRequest(Strict):
    """Give exactly one of `text` (tokenised here), `ids` (used as they are) or `messages` (a
    conversation rendered with a chat model's template)."""

    # the description says so too: exactly one of them (clients and fuzzers generate valid bodies)
    model_config = ConfigDict(**Strict.model_config, json_schema_extra={
        "oneOf": [{"required": ["text"]}, {"required": ["ids"]}, {"required": ["messages"]}]})

    model: ModelName | None = Field(None, description=MODEL_FIELD)
    text: Text | None = Field(None, min_length=1, description="text to tokenise and analyse")
    ids: list[int] | None = Field(
        None, min_length=1,
        description="token ids to analyse as they are, e.g. a prompt's `prompt_tokens` ids followed by the "
        "generated tokens' ids: no re-tokenising, so the maps match the generated sequence even where "
        "its text holds U+FFFD for partial UTF-8 characters",
    )
    messages: Messages | None = None
    layers: list[int] | None = Field(None, min_length=1, description="layer indices, default all")
    heads: list[int] | None = Field(None, min_length=1, description="head indices, default all")
    format: Literal["json", "f16", "u8"] = "json"
    packing: Literal["full", "tril"] = Field(
        "full",
        description="'full' = every cell row-major; 'tril' = per matrix only the cells on or below the "
        "diagonal, row by row (row i has i+1 values), ~half the bytes (with format=json each matrix "
        "is then a list of rows of growing length); causal (decoder) attention only",
    )
    # encoder-decoder only: `text` / `ids` are the source; the target is given or translated
    target: Text | None = Field(None, min_length=1, description="encoder-decoder only: the target text "
                               "(tokenised here); without target or target_ids, the model's greedy translation")
    target_ids: list[int] | None = Field(None, min_length=1, description="encoder-decoder only: the target's "
                                         "token ids as they are (without the decoder's start token)")
    ablate: Ablate = Field(None, description=ABLATE_DESCRIPTION + "; the maps are those of the ablated model "
                           "(an encoder-decoder's default target is still the unablated model's translation)")
    # what each map becomes, computed a block of query rows at a time (never the whole map held)
    pool: int | None = Field(None, ge=1, le=4096, description=(
        "each map as an N x N grid over contiguous, near-equal bins (fewer where a window is shorter; "
        "the answer's row_edges / col_edges give them): cell (i, j) is the mean, over the queries in "
        "row bin i, of the total attention they give to the keys in column bin j, so pooled rows "
        "still sum to 1; a causal map's empty upper cells are 0. Not with top_k"))
    top_k: int | None = Field(None, ge=1, le=1024, description=(
        "for every query row its k heaviest keys, heaviest first: `positions` (key positions, -1 "
        "where the weight is 0) and the weights as the maps, shape [L][H][rows][k]. Not with pool"))
    rows: list[int] | None = Field(None, min_length=2, max_length=2, description=(
        "[a, b]: query positions a .. b-1 only, at full resolution (or pooled, or top-k); each "
        "group's window is clipped to its own axis"))
    cols: list[int] | None = Field(None, min_length=2, max_length=2, description=(
        "[c, d]: key positions c .. d-1 only (the weights are still those of the whole row's softmax)"))

    @field_validator("rows", "cols")
    @classmethod
    def _window(cls, v):
        if v is not None and not 0 <= v[0] < v[1]:
            raise ValueError(f"a window [start, end] needs 0 <= start < end, got {v}")
        return v


class ReducedMaps(BaseModel):
    """What a group's answer states beside its maps: the window it covers; a pooled answer's bins; a
    top-k answer's keys."""

    rows: list[int] | None = Field(None, description="[a, b]: the query positions the maps cover")
    cols: list[int] | None = Field(None, description="[c, d]: the key positions the maps cover")
    row_edges: list[int] | None = Field(None, description="pool: the row bins' edges (bin i is edges[i] .. edges[i+1]-1)")
    col_edges: list[int] | None = Field(None, description="pool: the column bins' edges")
    positions: list[list[list[list[int]]]] | str | None = Field(
        None, description="top_k: each row's keys, heaviest first (-1: none); json nested lists, "
        "else base64 of little-endian int32")
    positions_dtype: Literal["int32"] | None = None


class AttentionGroup(ReducedMaps):
    """One group of maps in the format asked for (the same fields as the top level's)."""

    shape: list[int] = Field(description="[len(layers), len(heads), rows, columns]")
    attention: list[list[list[list[float]]]] | None = Field(None, description="format=json")
    data: str | None = Field(None, description="f16/u8: base64 of the row-major array")
    dtype: Literal["float16", "uint8"] | None = None
    packing: Literal["full", "tril"] | None = None
    scale: float | None = None


class TranslationAttention(BaseModel):
    """An encoder-decoder's second and third groups (the first, the encoder's self-attention
    over the source, is the answer's top-level maps). Rows of `decoder` and `cross` are
    `target_tokens` (the decoder's start token, then the target); columns of `cross` are the
    source tokens (the answer's `tokens`)."""

    target_tokens: list[TokenText]
    generated: bool = Field(description="true when the target is the model's own greedy translation")
    decoder: AttentionGroup = Field(description="decoder self-attention, [L][H][T][T], causal "
                                    "(packing 'tril' applies here only)")
    cross: AttentionGroup = Field(description="cross-attention, [L][H][T][S]: target rows over source columns")


class AttentionGroupAxes(BaseModel):
    """One of the family's attention groups as it declares it (GET /models has the full declaration)."""

    name: str
    queries: str = Field(description="the axis the rows run over: tokens, source or target")
    keys: str = Field(description="the axis the columns run over")
    causal: bool


class AttentionResponse(ReducedMaps):
    model: str
    family: str = Field("decoder", description="the model's family (GET /models describes its attention groups)")
    groups: list[AttentionGroupAxes] = Field(default_factory=list, description=(
        "the family's attention groups, the primary one (the top-level maps) first; the others are "
        "under `translation` by name"))
    direction: str = Field(
        "causal", description="the family's attention kind. causal: position i sees positions <= i (zero above the diagonal); "
        "bidirectional: every position sees every other (an encoder; full T x T maps); encoder-decoder: "
        "the top-level maps are the encoder's over the source, `translation` has the decoder's and the cross maps")
    tokens: list[TokenText] = Field(description="the analysed positions; an encoder's text is framed "
                                                "as [CLS] text [SEP]")
    n_layers: int
    n_heads: int
    layers: list[int]
    heads: list[int]
    format: Literal["json", "f16", "u8"]
    shape: list[int] = Field(description="[len(layers), len(heads), T, T]; pooled [.., N, N], top_k [.., rows, k], "
                                         "a window [.., b - a, d - c]")
    attention: list[list[list[list[float]]]] | None = Field(None, description="format=json")
    data: str | None = Field(None, description="f16/u8: base64 of the row-major array")
    dtype: Literal["float16", "uint8"] | None = Field(None, description="element type of data (little-endian)")
    packing: Literal["full", "tril"] | None = None
    scale: float | None = Field(None, description="u8: value = byte * scale")
    translation: TranslationAttention | None = Field(
        None, description="encoder-decoder only: `tokens` are the source and the top-level maps its "
        "encoder self-attention [L][H][S][S] (always packing 'full'); this holds the target's tokens, the "
        "decoder self-attention and the cross-attention")
    ablate: list[Ablation] | None = Field(None, description="the request's ablations, groups resolved")


# --- operations --------------------------------------------------------------
class Health(BaseModel):
    status: str


class ModelState(BaseModel):
    """How one model's engine is doing (app/engine/supervisor.py)."""

    state: Literal["starting", "running", "restarting", "failed", "stopped"]
    restarts: int = Field(0, description="engine processes started again after one stopped")
    detail: str | None = Field(None, description="why it does not run, when it does not")


class Readiness(BaseModel):
    ready: bool
    status: str
    detail: str | None = None
    models: dict[str, ModelState] | None = Field(None, description="each model's state, by name")


class ModelInfo(BaseModel):
    name: str
    path: str = Field(description="the checkpoint directory's name (never the server's absolute path)")
    architecture: dict[str, Any]
    parameters: int
    parameters_without_embeddings: int
    device: str
    dtype: str
    context_length: int
    vocab_size: int
    tokenizer_vocab_size: int
    training: dict[str, Any] | None
    limits: dict[str, int]


class ErrorBody(BaseModel):
    """A native error: `detail` is a message, or pydantic's list of {loc, msg, type} for a 422."""

    detail: Any
    param: str | None = Field(None, description="the request field to fix, when one is to blame")
    code: str | None = Field(None, description="machine-readable reason, e.g. context_length_exceeded")
