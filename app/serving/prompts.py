"""A request's prompt turned into checked token ids without blocking the loop: a text, token ids,
a conversation rendered with the model's chat template, or what an analysis route names (its
sequence and target); and the checks of a generation's lengths against the limits and the context.

Text is tokenised on a worker thread, and only after a byte-length check: byte-level BPE
tokens are at most `longest_token_bytes` bytes each, so a text of more than
`limit * longest_token_bytes` bytes has more than `limit` tokens whatever it says. Such a
text is refused at once, without tokenising a megabyte at all. The worker thread calls the
tokenizers library's batch encoder, which lets go of Python's GIL while it works (its
one-text `encode` holds it throughout, and so would stall the event loop as surely as
running on it). Token ids are counted first, then checked against the vocabulary, naming
the first bad one and where it is.

A conversation becomes a prompt as transformers' `apply_chat_template(messages,
add_generation_prompt=True)` makes it. The template is the checkpoint's own (tokenizer_config.json
`chat_template`), a Jinja2 program written for transformers, run here the way transformers runs it,
so a conversation becomes the same text and the same ids:
- an ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks and the loopcontrols
  extension (templates come from strangers: the sandbox forbids attribute tricks);
- the helpers templates call: `raise_exception(message)`, `strftime_now(format)`, a `tojson`
  filter that does not escape HTML, `dict(...)` and `namespace(...)`;
- the variables: `messages`, `add_generation_prompt`, `tools` and `documents` (None), and the
  tokenizer's special tokens by name (`bos_token`, `eos_token`, ...);
- the rendered text is tokenised without adding special tokens (the template writes them).
A template error (raise_exception, a syntax error, an undefined name used as a callable) is the
request's fault or the template's: `ChatTemplateError` carries its message for a 400. A model
whose checkpoint has no template (every bundled one) is a 400 `no_chat_template` that says how
to get one.

What an analysis route names (/attention, /heads, the explain routes) is read one way: its token
ids (`text` | `ids` | `messages`, a text framed as the model's family frames one) and its target
(`target` | `target_ids`, for a model that reads one), each checked against the model's
vocabulary and context with a 400 naming the field.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from starlette.concurrency import run_in_threadpool

from attnlens.app.api.common_schemas import ChatMessage
from attnlens.app.registry.model_registry import CHAT, ServedModel
from attnlens.app.server.api_errors import ApiError, field_error
from attnlens.app.server.settings import Settings
from attnlens.app.server.state import AppState
from attnlens.app.serving.answer_budget import off_loop
from attnlens.app.serving.encoder_tasks import TaskInputError, framed_ids
from attnlens.model.families import GenerationSpec
from attnlens.model.tokenizer import Tokenizer


# --- text and token ids -----------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _longest_token_bytes(tokenizer: Tokenizer) -> int:
    return max(len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size))


def longest_token_bytes(tokenizer: Tokenizer) -> int:
    """The most bytes one token stands for (so the fewest tokens a text can have)."""
    return _longest_token_bytes(tokenizer)


def check_text_bytes(tokenizer: Tokenizer, text: str, limit: int, *, field: str, limit_name: str) -> None:
    """A 400 (code prompt_too_long) when the UTF-8 bytes of `text` alone prove it has more than
    `limit` tokens."""
    n_bytes = len(text.encode("utf-8"))
    if n_bytes > limit * longest_token_bytes(tokenizer):
        raise ApiError(400, f"{field} is {n_bytes} bytes long, so it has more than {limit} tokens "
                            f"({limit_name}) whatever they are", param=field, code="prompt_too_long")


async def tokenize_text(tokenizer: Tokenizer, text: str, limit: int, *, field: str, limit_name: str,
                        prompt: bool = False) -> list[int]:
    """Token ids of `text`, tokenised on a worker thread once check_text_bytes lets it through
    (`prompt`: as tokenize_texts says)."""
    check_text_bytes(tokenizer, text, limit, field=field, limit_name=limit_name)
    return (await tokenize_texts(tokenizer, [text], prompt=prompt))[0]


async def tokenize_texts(tokenizer: Tokenizer, texts: list[str], *, prompt: bool = False) -> list[list[int]]:
    """Token ids of each text (already checked by their bytes), on a worker thread with the GIL
    let go while the tokenizer works. A `prompt` is fed as transformers' tokenizer(text) gives
    it: BOS first where the tokenizer adds one (Llama, Mistral: Tokenizer.encode_prompt)."""
    if not texts:
        return []
    ids = await run_in_threadpool(tokenizer.encode_batch, texts)
    if prompt and tokenizer.add_bos:
        ids = [[*tokenizer.prompt_prefix, *row] for row in ids]
    return ids


def check_token_ids(tokenizer: Tokenizer, ids: list[int], *, field: str, limit: int | None = None,
                    limit_name: str = "ATTNLENS_MAX_PROMPT_TOKENS") -> list[int]:
    """`ids` if every one is in the vocabulary, else a 422 naming the first that is not; with
    `limit`, more than `limit` ids are a 400 before any is looked at."""
    if limit is not None and len(ids) > limit:
        raise ApiError(400, f"{field} has {len(ids)} tokens, more than the limit of {limit} ({limit_name})",
                       param=field, code="prompt_too_long")
    vocab = tokenizer.vocab_size
    for pos, i in enumerate(ids):
        if not 0 <= i < vocab:
            raise field_error(field, f"token id {i} (at position {pos}) is not in the vocabulary: ids run "
                                     f"0..{vocab - 1}", "out_of_range")
    return list(ids)


# --- a generation's lengths: the service's limits and the model's context -----------
def check_new_token_limit(settings: Settings, value: int, field: str) -> None:
    """A 422 on `field` when more new tokens are asked for than ATTNLENS_MAX_NEW_TOKENS allows."""
    if value > settings.max_new_tokens:
        raise field_error(field, f"Input should be less than or equal to {settings.max_new_tokens}",
                          "less_than_equal")


def check_lengths(context_length: int, settings: Settings, prompt_ids: list[int], max_new_tokens: int,
                  generation: GenerationSpec, *, prompt_field: str = "prompt", max_field: str = "max_new_tokens") -> None:
    """A clear 400 naming the numbers when a prompt cannot be served. A prompt the family reads as
    a source (an encoder-decoder's; GenerationSpec.prompt) has an output with a context of its
    own: the source must fit, and the output stops at the context length (finish_reason
    "length") whatever max_new_tokens asks for, as a translation ends at its EOS long before."""
    n = len(prompt_ids)
    ctx = context_length
    if n == 0:
        raise ApiError(400, f"{prompt_field} encodes to no tokens", param=prompt_field, code="empty_prompt")
    if n > settings.prompt_limit:
        raise ApiError(400, f"{prompt_field} has {n} tokens, more than the limit of "
                            f"{settings.prompt_limit} (ATTNLENS_MAX_PROMPT_TOKENS)",
                       param=prompt_field, code="prompt_too_long")
    if generation.prompt == "source":
        if n > ctx:
            raise ApiError(400, f"{prompt_field} has {n} tokens; this model reads a source of at most "
                                f"{ctx} tokens (its context length)", param=prompt_field, code="context_length_exceeded")
        return
    if n + max_new_tokens > ctx:
        raise ApiError(400, f"{prompt_field} ({n} tokens) + {max_field} ({max_new_tokens}) = "
                            f"{n + max_new_tokens} tokens exceeds the model's context length of {ctx}",
                       param=max_field, code="context_length_exceeded")


# --- a conversation: the checkpoint's chat template ------------------------------
class ChatTemplateError(ValueError):
    """The template could not render this conversation (its own message, or Jinja's)."""


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace() that refuses underscore names (no reaching CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = lambda *a, **k: dict(*a, **k)
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"the model's chat template does not compile: {e}") from None


def render_chat(template: str, messages: list[dict], special_tokens: dict[str, str], *,
                add_generation_prompt: bool = True) -> str:
    """The conversation as the template writes it (messages are plain dicts: role, content, ...)."""
    try:
        return compile_template(template).render(messages=messages, tools=None, documents=None,
                                                 add_generation_prompt=add_generation_prompt, **special_tokens)
    except ChatTemplateError:
        raise
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"the model's chat template refused this conversation: {e}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise ChatTemplateError(f"the model's chat template failed on this conversation: {type(e).__name__}: {e}") \
            from None


def template_message(message: ChatMessage) -> dict:
    """The message as transformers hands it to a chat template: a plain dict (list content joined
    with "\\n", as vLLM joins it)."""
    content = message.content
    text = content if isinstance(content, str) else "\n".join(p.text for p in content)
    return {"role": message.role, "content": text, **({"name": message.name} if message.name is not None else {})}


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
        text = await run_in_threadpool(render_chat, template, [template_message(m) for m in messages],
                                       tok.template_tokens, add_generation_prompt=True)
    except ChatTemplateError as e:
        raise ApiError(400, str(e), param="messages", code="chat_template_error") from None
    check_text_bytes(tok, text, limit, field="messages", limit_name=limit_name)
    ids = (await tokenize_texts(tok, [text]))[0]
    if not ids:
        raise ApiError(400, "messages render to no tokens", param="messages", code="empty_prompt")
    return ids


# --- what an analysis route names: its sequence and target ---------------------
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
