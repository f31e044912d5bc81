"""A GGUF file's tokenizer, rebuilt with the `tokenizers` library from its metadata.

llama.cpp stores a byte-level BPE tokenizer (`tokenizer.ggml.model` = "gpt2": GPT-2, Llama 3,
Qwen2, SmolLM) as its tokens (already in GPT-2's byte alphabet), its merges, each token's
type (3 = control, 4 = user-defined), the special ids, whether prompts start with BOS, and
the name of the pre-tokenizer (`tokenizer.ggml.pre`): how text is split before the merges.
Each name below is the split llama.cpp's llama-vocab.cpp applies for it, written as the
`tokenizers` pre-tokenizers that the model's own tokenizer.json uses:

    default, gpt2      GPT-2's regex
    smollm             every digit alone, then GPT-2's regex (SmolLM, SmolLM2)
    llama-bpe, ...     Llama 3's regex (numbers in runs of up to three)
    qwen2, ...         Qwen2's regex (every digit alone)

The chat template is `tokenizer.chat_template`. A SentencePiece tokenizer ("llama": Llama 2,
TinyLlama, Mistral) or another pre-tokenizer is refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from attnlens.model.checkpoint import CheckpointError
from attnlens.model.tokenizer import SpecialTokens, Tokenizer

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gpt2_split():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _regex_split(regex: str):
    return lambda: pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# tokenizer.ggml.pre -> (the pre-tokenizer, whether the merges are skipped for whole-word tokens)
PRE_TOKENIZERS = {
    "default": (_gpt2_split, False),
    "gpt2": (_gpt2_split, False),
    "smollm": (lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_split()]),
               False),
    "llama-bpe": (_regex_split(_LLAMA3_SPLIT), True),
    "llama3": (_regex_split(_LLAMA3_SPLIT), True),
    "smaug-bpe": (_regex_split(_LLAMA3_SPLIT), True),
    "qwen2": (_regex_split(_QWEN2_SPLIT), False),
    "deepseek-r1-qwen": (_regex_split(_QWEN2_SPLIT), False),
}


def tokenizer_from_metadata(meta: dict[str, Any], path: Path) -> Tokenizer:
    """The Tokenizer (with its special tokens, BOS flag, stop ids and chat template) a GGUF
    file's `tokenizer.*` metadata describes."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(f"{path}: GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2', "
                              "byte-level BPE)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"{path}: GGUF pre-tokenizer {pre!r} is not supported "
                              f"(supported: {', '.join(PRE_TOKENIZERS)})")
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not tokens:
        raise CheckpointError(f"{path}: GGUF metadata 'tokenizer.ggml.tokens' is missing")
    if not isinstance(merges, list):
        raise CheckpointError(f"{path}: GGUF metadata 'tokenizer.ggml.merges' is missing (a byte-level BPE needs them)")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    make_pre, ignore_merges = PRE_TOKENIZERS[pre]
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=ignore_merges))
    backend.pre_tokenizer = make_pre()
    backend.decoder = decoders.ByteLevel()
    # control tokens stay whole and are special; user-defined ones stay whole (llama.cpp matches both in text)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, types) if kind == CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in zip(tokens, types) if kind == USER_DEFINED])

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    stop = [meta.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    template = meta.get("tokenizer.chat_template")
    special = SpecialTokens(bos=token("bos"), eos=token("eos"), pad=token("padding"), unk=token("unknown"),
                            add_bos=add_bos if isinstance(add_bos, bool) else False,
                            stop_ids=tuple(dict.fromkeys(i for i in stop if isinstance(i, int))),
                            chat_template=template if isinstance(template, str) else None)
    return Tokenizer(backend, special)
