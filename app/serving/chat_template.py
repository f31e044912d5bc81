"""A checkpoint's chat template, rendered as transformers renders it (`apply_chat_template`).

The template is the checkpoint's own (tokenizer_config.json `chat_template`), a Jinja2 program
written for transformers. It runs here the way transformers runs it, so a conversation becomes
the same text and the same ids:
- an ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks and the loopcontrols
  extension (templates come from strangers: the sandbox forbids attribute tricks);
- the helpers templates call: `raise_exception(message)`, `strftime_now(format)`, a `tojson`
  filter that does not escape HTML, `dict(...)` and `namespace(...)`;
- the variables: `messages`, `add_generation_prompt`, `tools` and `documents` (None), and the
  tokenizer's special tokens by name (`bos_token`, `eos_token`, ...);
- the rendered text is tokenised without adding special tokens (the template writes them).

A template error (raise_exception, a syntax error, an undefined name used as a callable) is the
request's fault or the template's: `ChatTemplateError` carries its message for a 400.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


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
