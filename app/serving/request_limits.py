"""Checks of a generation request against the service's limits and the model's context (4xx)."""

from __future__ import annotations

from attnlens.app.server.api_errors import ApiError, field_error
from attnlens.app.server.settings import Settings
from attnlens.model.families import GenerationSpec


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
