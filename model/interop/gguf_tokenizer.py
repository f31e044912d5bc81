"""A GGUF file's tokenizer, rebuilt with the `tokenizers` library from its metadata.

Two kinds of `tokenizer.ggml.model` are read, each as llama.cpp's src/llama-vocab.cpp runs it:

gpt2 (byte-level BPE: GPT-2, Llama 3, Qwen2, SmolLM): the tokens (already in GPT-2's byte
alphabet), the merges, each token's type, the special ids, whether prompts start with BOS, and
the name of the pre-tokenizer (`tokenizer.ggml.pre`): how text is split before the merges.
Each name below is the split llama.cpp applies for it, written as the `tokenizers`
pre-tokenizers that the model's own tokenizer.json uses:

    default, gpt2      GPT-2's regex
    smollm             every digit alone, then GPT-2's regex (SmolLM, SmolLM2)
    llama-bpe, ...     Llama 3's regex (numbers in runs of up to three)
    qwen2, ...         Qwen2's regex (every digit alone)

llama (SentencePiece BPE: Llama 2, TinyLlama, Mistral v0.1-0.3, Gemma 2 / 3, Phi-3): the tokens
("▁" for a space, "<0xNN>" for a byte), their scores and types, and no merges. llama.cpp's SPM
tokenizer escapes spaces as "▁" (after a leading space when `tokenizer.ggml.add_space_prefix`,
true unless said: Gemma's files say false), then merges, among adjacent pieces whose join is a
token, the join with the highest score first, and spells a character no token covers as its
byte tokens. That is a BPE whose merges are every split of a token into two tokens, ordered by
the token's score (the way transformers' LlamaConverter derives them), with byte fallback; the
prefix is a normalizer, so that, as in llama.cpp, the text after each whole token gets it too.

Both kinds: control (3) and unknown (2) tokens are matched whole in a text as special tokens,
user-defined ones (4) as plain whole tokens, as llama.cpp does (parse_special). The chat
template is `tokenizer.chat_template`. Another tokenizer model or pre-tokenizer is refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from attnlens.model.checkpoint import CheckpointError
from attnlens.model.tokenizer import SpecialTokens, Tokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4  # llama.cpp's token types (5 unused, 6 byte)
SPACE = "\u2581"  # "▁": SentencePiece's space

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# what llama.cpp's vocabulary loader takes for a SentencePiece file that does not say
SPM_DEFAULT_IDS = {"bos": 1, "eos": 2, "unknown": 0}
# tokens llama.cpp ends a generation at by their text (besides eos / eot / eom), as in llama-vocab.cpp
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
             "<EOT>", "<|end_of_text|>")


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
TOKENIZER_MODELS = ("gpt2", "llama")


def tokenizer_from_metadata(meta: dict[str, Any], path: Path) -> Tokenizer:
    """The Tokenizer (with its special tokens, BOS flag, stop ids and chat template) a GGUF
    file's `tokenizer.*` metadata describes."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in TOKENIZER_MODELS:
        raise CheckpointError(f"{path}: GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2', "
                              "byte-level BPE; 'llama', SentencePiece BPE)")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise CheckpointError(f"{path}: GGUF metadata 'tokenizer.ggml.tokens' is missing")
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if kind == "gpt2":
        backend = byte_level_bpe(meta, tokens, path)
        _add_whole_tokens(backend, tokens, types, special=(CONTROL,))
    else:
        backend = sentencepiece_bpe(meta, tokens, path)
        _add_whole_tokens(backend, tokens, types, special=(CONTROL, UNKNOWN), rstrip=_phi3_rstrip(meta, tokens, types))
    return Tokenizer(backend, special_tokens(meta, tokens, spm=kind == "llama"))


def byte_level_bpe(meta: dict[str, Any], tokens: list[str], path: Path) -> HFTokenizer:
    """GPT-2-style BPE: the file's merges over its pre-tokenizer's pieces, in GPT-2's byte alphabet."""
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"{path}: GGUF pre-tokenizer {pre!r} is not supported "
                              f"(supported: {', '.join(PRE_TOKENIZERS)})")
    merges = meta.get("tokenizer.ggml.merges")
    if not isinstance(merges, list):
        raise CheckpointError(f"{path}: GGUF metadata 'tokenizer.ggml.merges' is missing (a byte-level BPE needs them)")
    make_pre, ignore_merges = PRE_TOKENIZERS[pre]
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=ignore_merges))
    backend.pre_tokenizer = make_pre()
    backend.decoder = decoders.ByteLevel()
    return backend


def sentencepiece_bpe(meta: dict[str, Any], tokens: list[str], path: Path) -> HFTokenizer:
    """llama.cpp's SPM tokenizer as a BPE: merges by score, byte fallback, "▁" for a space."""
    scores = meta.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) < len(tokens):
        raise CheckpointError(f"{path}: GGUF metadata 'tokenizer.ggml.scores' is missing or short "
                              "(a SentencePiece tokenizer merges by them)")
    vocab = {token: i for i, token in enumerate(tokens)}
    unk = _token(meta, tokens, "unknown", SPM_DEFAULT_IDS["unknown"])
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges_by_score(tokens, scores), unk_token=unk,
                                     fuse_unk=True, byte_fallback=True))
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True) is not False
    # a normalizer: the prefix goes in front of each piece of text between whole tokens, as in
    # llama.cpp ("prefix with space if previous is special")
    backend.normalizer = normalizers.Sequence([*([normalizers.Prepend(SPACE)] if prefix else []),
                                               normalizers.Replace(" ", SPACE)])
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *([decoders.Strip(" ", 1, 0)] if prefix else [])])
    return backend


def merges_by_score(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, the token with the highest score first (then the
    lower id, then the shorter left part): llama.cpp joins the adjacent pair whose join scores best."""
    ids = {token: i for i, token in enumerate(tokens)}
    found = [(-float(scores[i]), i, k, token[:k], token[k:]) for i, token in enumerate(tokens)
             for k in range(1, len(token)) if token[:k] in ids and token[k:] in ids]
    found.sort(key=lambda f: f[:3])
    return [(left, right) for *_, left, right in found]


def _add_whole_tokens(backend: HFTokenizer, tokens: list[str], types: list[int], *, special: tuple[int, ...],
                      rstrip: frozenset[str] = frozenset()) -> None:
    """Tokens matched whole in a text before anything else: `special` types as special tokens,
    user-defined ones as plain tokens; those in `rstrip` take the whitespace after them."""
    def added(token: str, is_special: bool) -> AddedToken:
        return AddedToken(token, special=is_special, normalized=False, rstrip=token in rstrip)

    backend.add_special_tokens([added(t, True) for t, kind in zip(tokens, types) if kind in special])
    backend.add_tokens([added(t, False) for t, kind in zip(tokens, types) if kind == USER_DEFINED])


def _phi3_rstrip(meta: dict[str, Any], tokens: list[str], types: list[int]) -> frozenset[str]:
    """llama.cpp strips the whitespace after a Phi-3 file's whole tokens (known by general.name),
    but not after <unk>, <s> and <|endoftext|>."""
    name = str(meta.get("general.name", "")).lower()
    if "phi-3" not in name and "phi3" not in name:
        return frozenset()
    whole = {t for t, kind in zip(tokens, types) if kind in (UNKNOWN, CONTROL, USER_DEFINED)} | {"</s>"}
    return frozenset(whole - {"<unk>", "<s>", "<|endoftext|>"})


def _token(meta: dict[str, Any], tokens: list[str], key: str, default: int | None = None) -> str | None:
    """The token `tokenizer.ggml.{key}_token_id` names (else the one at `default`), None if neither."""
    i = meta.get(f"tokenizer.ggml.{key}_token_id", default)
    return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None


def special_tokens(meta: dict[str, Any], tokens: list[str], *, spm: bool) -> SpecialTokens:
    """The special tokens, BOS flag, stop ids and chat template; a SentencePiece file's defaults
    are llama.cpp's (BOS 1 and added to a prompt, EOS 2, unknown 0) and it also stops at the
    tokens llama.cpp knows by their text (<end_of_turn>, <|end|>, ...)."""
    defaults = SPM_DEFAULT_IDS if spm else {}
    stop = [meta.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    if spm:
        ids = {token: i for i, token in enumerate(tokens)}
        stop += [ids[t] for t in EOG_TEXTS if t in ids]
    add_bos = meta.get("tokenizer.ggml.add_bos_token", True if spm else False)
    template = meta.get("tokenizer.chat_template")
    return SpecialTokens(bos=_token(meta, tokens, "bos", defaults.get("bos")),
                         eos=_token(meta, tokens, "eos", defaults.get("eos")),
                         pad=_token(meta, tokens, "padding"),
                         unk=_token(meta, tokens, "unknown", defaults.get("unknown")),
                         add_bos=add_bos if isinstance(add_bos, bool) else False,
                         stop_ids=tuple(dict.fromkeys(i for i in stop if isinstance(i, int))),
                         chat_template=template if isinstance(template, str) else None)
