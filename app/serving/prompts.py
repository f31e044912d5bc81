"""Turn a request's prompt (text or token ids) into checked token ids without blocking the loop.

Text is tokenised on a worker thread, and only after a byte-length check: byte-level BPE
tokens are at most `longest_token_bytes` bytes each, so a text of more than
`limit * longest_token_bytes` bytes has more than `limit` tokens whatever it says. Such a
text is refused at once, without tokenising a megabyte at all. The worker thread calls the
tokenizers library's batch encoder, which lets go of Python's GIL while it works (its
one-text `encode` holds it throughout, and so would stall the event loop as surely as
running on it). Token ids are counted first, then checked against the vocabulary, naming
the first bad one and where it is.
"""

from __future__ import annotations

import functools

from starlette.concurrency import run_in_threadpool

from attnlens.app.server.api_errors import ApiError, field_error
from attnlens.model.tokenizer import Tokenizer


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
