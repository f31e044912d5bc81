"""Byte-level BPE (as GPT-2) through the `tokenizers` library, stored as tokenizer.json.

Besides encode/decode it gives each token's *display text*: the characters a person
should see on a heatmap axis. Byte-level BPE can split one multi-byte character across
tokens; such a fragment is shown as its bytes, e.g. ``<0xE4><0xBD>``, never as mojibake.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Iterable

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
# The encoder's special tokens (BERT's names). The text "[MASK]" in an input *is* the mask
# token; like RoBERTa's <mask> it absorbs the space before it, so "the [MASK] of" masks the
# word token " king" in "the king of" rather than leaving a lone space token in front.
PAD_TOKEN, CLS_TOKEN, SEP_TOKEN, MASK_TOKEN = "[PAD]", "[CLS]", "[SEP]", "[MASK]"
ENCODER_SPECIAL_TOKENS = (PAD_TOKEN, CLS_TOKEN, SEP_TOKEN, MASK_TOKEN)


@functools.lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


@functools.lru_cache(maxsize=1)
def unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_unicode().items()}


def bytes_for_display(data: bytes) -> str:
    """UTF-8 text of `data`; bytes that are not (complete) UTF-8 become ``<0xNN>``."""
    out = []
    i = 0
    while i < len(data):
        # Try the longest valid UTF-8 sequence starting here (1..4 bytes).
        for width in (1, 2, 3, 4):
            chunk = data[i : i + width]
            try:
                out.append(chunk.decode("utf-8"))
                i += width
                break
            except UnicodeDecodeError:
                continue
        else:
            out.append(f"<0x{data[i]:02X}>")
            i += 1
    return "".join(out)


class Tokenizer:
    """A thin wrapper around a `tokenizers.Tokenizer` with byte-level BPE."""

    def __init__(self, backend: HFTokenizer):
        self.backend = backend
        self._token_bytes: dict[int, bytes] = {}
        self._display: dict[int, str] = {}
        self.eos_id = backend.token_to_id(EOS_TOKEN)
        # None when this tokenizer has no such token (a decoder's tokenizer)
        self.pad_id = backend.token_to_id(PAD_TOKEN)
        self.cls_id = backend.token_to_id(CLS_TOKEN)
        self.sep_id = backend.token_to_id(SEP_TOKEN)
        self.mask_id = backend.token_to_id(MASK_TOKEN)
        # Byte-level BPE (ours, GPT-2's) maps tokens to bytes exactly; an imported WordPiece
        # (BERT's) tokenizer is shown by its token text ("##" continuation, else a new word).
        self.byte_level = "ByteLevel" in type(backend.decoder).__name__ if backend.decoder else False

    # --- construction ------------------------------------------------------
    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        *,
        show_progress: bool = False,
        encoder_tokens: bool = False,
    ) -> "Tokenizer":
        """Byte-level BPE; `encoder_tokens` adds [PAD] [CLS] [SEP] [MASK] (ids 1-4) after EOS."""
        backend = HFTokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=2,
            special_tokens=[EOS_TOKEN, *(ENCODER_SPECIAL_TOKENS if encoder_tokens else ())],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=show_progress,
        )
        backend.train_from_iterator(texts, trainer=trainer)
        if encoder_tokens:  # re-register [MASK] so that it takes the space before it
            backend.add_special_tokens([AddedToken(MASK_TOKEN, lstrip=True, special=True, normalized=False)])
        return cls(backend)

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        return cls(HFTokenizer.from_file(str(path)))

    @classmethod
    def from_str(cls, text: str) -> "Tokenizer":
        return cls(HFTokenizer.from_str(text))

    @classmethod
    def from_vocab_merges(cls, vocab_path: str | Path, merges_path: str | Path) -> "Tokenizer":
        """GPT-2's original vocab.json + merges.txt."""
        backend = HFTokenizer(models.BPE.from_file(str(vocab_path), str(merges_path)))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        if backend.token_to_id(EOS_TOKEN) is not None:
            backend.add_special_tokens([EOS_TOKEN])
        return cls(backend)

    def save(self, path: str | Path) -> None:
        self.backend.save(str(path))

    def transformers_files(self, context_length: int) -> dict[str, dict]:
        """special_tokens_map.json and tokenizer_config.json for a directory that also holds
        tokenizer.json, so `transformers.AutoTokenizer` loads it with bos/eos (and unk, pad
        left unset) naming the end-of-text token, as GPT-2's do."""
        special = {"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "unk_token": EOS_TOKEN} \
            if self.eos_id is not None else {}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": context_length,
                  "add_prefix_space": False, "clean_up_tokenization_spaces": False, **special}
        return {"special_tokens_map.json": special, "tokenizer_config.json": config}

    def to_str(self) -> str:
        return self.backend.to_str()

    # --- use ---------------------------------------------------------------
    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of every special token (EOS and the encoder's), never masked or predicted."""
        ids = (self.eos_id, self.pad_id, self.cls_id, self.sep_id, self.mask_id)
        return frozenset(i for i in ids if i is not None)

    @property
    def has_encoder_tokens(self) -> bool:
        return None not in (self.pad_id, self.cls_id, self.sep_id, self.mask_id)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Exact text for ids; a trailing partial character decodes as U+FFFD."""
        if not self.byte_level:
            return self.backend.decode(list(ids), skip_special_tokens=False)
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for."""
        cached = self._token_bytes.get(token_id)
        if cached is None:
            token = self.backend.id_to_token(int(token_id))
            if token is None:
                raise KeyError(f"token id {token_id} is not in the vocabulary")
            if token == EOS_TOKEN or token in self._special_tokens():
                cached = token.encode("utf-8")
            elif not self.byte_level:
                cached = (token[2:] if token.startswith("##") else " " + token).encode("utf-8")
            else:
                table = unicode_to_byte()
                cached = bytes(table[c] for c in token)
            self._token_bytes[token_id] = cached
        return cached

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return b"".join(self.token_bytes(i) for i in ids)

    def display_text(self, token_id: int) -> str:
        """What a person should see for this token on its own (spaces and newlines kept)."""
        text = self._display.get(token_id)
        if text is None:  # every streamed token and alternative asks: worked out once per id
            text = self._display[token_id] = bytes_for_display(self.token_bytes(token_id))
        return text

    def display_texts(self, ids: Iterable[int]) -> list[str]:
        return [self.display_text(i) for i in ids]

    @functools.cached_property
    def _special_set(self) -> frozenset[str]:
        added = self.backend.get_added_tokens_decoder() if hasattr(self.backend, "get_added_tokens_decoder") else {}
        return frozenset(t.content for t in added.values() if getattr(t, "special", False))

    def _special_tokens(self) -> frozenset[str]:
        return self._special_set
