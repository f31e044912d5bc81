"""What the native API's requests share: valid text, strict models, a model's name, stop strings,
ablations, and a conversation's messages (/generate, /attention, the explain routes, /v1/chat)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Any length constraint, even min_length=0, makes pydantic-core read a str as Unicode, which refuses
# a lone surrogate ("\ud800", which JSON can carry and no tokenizer can encode): a 422
# `string_unicode` naming the field (api_errors.py says why), with no Python validator per field.
Text = Annotated[str, Field(min_length=0)]
"""A str that is valid Unicode (encodes to UTF-8): what every text field of a request is."""
NonEmptyText = Annotated[str, Field(min_length=1)]
"""A Text that is not "" (e.g. one item of a list of texts)."""


class Strict(BaseModel):
    """Unknown fields are an error (422), so a misspelt option is never silently ignored; types
    are strict, so `"4"` or `true` is no integer and `"yes"` no boolean."""

    model_config = ConfigDict(extra="forbid", strict=True, ser_json_inf_nan="constants")


# --- fields every request shares ------------------------------------------------
MODEL_FIELD = "a loaded model's name (GET /models); default: the default model (for a task only one loaded " \
              "model can do, e.g. fill-mask, that model)"
ModelName = Annotated[str, Field(min_length=1, max_length=256)]
"""A `model` field: a loaded model's name; "" is no name (a 422), not the default model."""

MAX_STOPS = 4  # stop strings per request, as OpenAI allows
MAX_STOP_CHARS = 256  # characters in one stop string (matched on the text as it is generated)
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
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
    content: Text | Annotated[list[TextPart], Field(min_length=1, max_length=MAX_CONTENT_PARTS)] = Field(
        description=f"the turn's text, or a list of 1..{MAX_CONTENT_PARTS} text parts")
    name: Text | None = Field(None, max_length=256, description="passed to the template, which may use it")


Messages = Annotated[list[ChatMessage], Field(min_length=1, description=(
    "a conversation (OpenAI's messages) for a model with a chat template (GET /models lists `chat` in its "
    "tasks): rendered with the template, ending in the assistant's turn, and tokenised as transformers' "
    "apply_chat_template does; at most ATTNLENS_MAX_CHAT_MESSAGES messages"))]


