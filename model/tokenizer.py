"""Tokenizers through the `tokenizers` library, stored as tokenizer.json: the byte-level BPE
attnlens trains (as GPT-2's), and a checkpoint's own tokenizer.json when it is imported.

Besides encode/decode it gives each token's *bytes* (what streaming adds up) and its *display
text*: the characters a person should see on a heatmap axis. How a token's string maps to
bytes is the tokenizer's scheme, read from its decoder:

    byte_level  GPT-2, Llama 3, Qwen2, SmolLM: every byte is one printable character ("Ġ" = " ")
    metaspace   SentencePiece-style BPE (Llama 2, TinyLlama, Mistral): "▁" is a space, and
                with byte fallback "<0xE4>" is the byte E4
    wordpiece   BERT: "##" continues a word, any other token starts one after a space

A multi-byte character split across tokens is shown as its bytes, e.g. ``<0xE4><0xBD>``,
never as mojibake.

An imported tokenizer keeps its special tokens (bos/eos by name), its chat template and
whether prompts start with BOS (tokenizer_config.json), and every id that ends a generation
(generation_config.json): `special_tokens` and `chat_template`, written back beside
tokenizer.json by `transformers_files`.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable

from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

EOS_TOKEN = "<|endoftext|>"
# The encoder's special tokens (BERT's names). The text "[MASK]" in an input *is* the mask
# token; like RoBERTa's <mask> it absorbs the space before it, so "the [MASK] of" masks the
# word token " king" in "the king of" rather than leaving a lone space token in front.
PAD_TOKEN, CLS_TOKEN, SEP_TOKEN, MASK_TOKEN = "[PAD]", "[CLS]", "[SEP]", "[MASK]"
ENCODER_SPECIAL_TOKENS = (PAD_TOKEN, CLS_TOKEN, SEP_TOKEN, MASK_TOKEN)
SCHEMES = ("byte_level", "metaspace", "wordpiece")
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback pieces


@dataclass(frozen=True)
class SpecialTokens:
    """What a checkpoint's tokenizer_config.json says about its special tokens (None: not said).

    bos / eos / pad / unk are token strings; `add_bos` says whether a prompt starts with BOS
    (Llama, Mistral: yes; Qwen2, GPT-NeoX, GPT-2: no); `stop_ids` are ids besides EOS that end
    a generation (generation_config.json's eos_token_id list: Llama 3's <|eot_id|>, Qwen2's
    <|im_end|>); `chat_template` is the Jinja template that renders a conversation.
    """

    bos: str | None = None
    eos: str | None = None
    pad: str | None = None
    unk: str | None = None
    add_bos: bool | None = None
    stop_ids: tuple[int, ...] = ()
    chat_template: str | None = None

    @property
    def carried(self) -> bool:
        """Whether anything was read (an imported tokenizer), or this is attnlens' own default."""
        return self != SpecialTokens()


# the special tokens attnlens' own checkpoints name in tokenizer_config.json: its default
ATTNLENS_DEFAULTS = SpecialTokens(bos=EOS_TOKEN, eos=EOS_TOKEN, unk=EOS_TOKEN)


def _token_name(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a string, or an AddedToken's {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _ids(value: Any) -> list[int]:
    """An eos_token_id field: an int, a list of ints, or null."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def read_special_tokens(directory: str | Path, model_config: dict | None = None) -> SpecialTokens:
    """The special tokens of a transformers (or attnlens) directory: tokenizer_config.json, then
    special_tokens_map.json, then (by id, needing the tokenizer: see Tokenizer.from_dir) the model's
    config.json; the chat template from tokenizer_config.json or chat_template.jinja (newer
    transformers save it there); the extra stop ids from generation_config.json.

    Raises ValueError naming the file for a file that is not a JSON object."""
    d = Path(directory)
    config = _read_json(d / "tokenizer_config.json")
    special_map = _read_json(d / "special_tokens_map.json")
    generation = _read_json(d / "generation_config.json")
    names = {key: _token_name(config.get(f"{key}_token")) or _token_name(special_map.get(f"{key}_token"))
             for key in ("bos", "eos", "pad", "unk")}
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja = d / "chat_template.jinja"
    if not isinstance(template, str) and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    add_bos = config.get("add_bos_token")
    stop = _ids(generation.get("eos_token_id")) + _ids((model_config or {}).get("eos_token_id"))
    special = SpecialTokens(**names, add_bos=add_bos if isinstance(add_bos, bool) else None,
                            stop_ids=tuple(dict.fromkeys(stop)),
                            chat_template=template if isinstance(template, str) else None)
    # what attnlens writes for its own tokenizers (Tokenizer.transformers_files) means its default
    return SpecialTokens() if special == ATTNLENS_DEFAULTS else special


def _decoder_types(decoder) -> list[str]:
    """The type names in a tokenizers decoder (a Sequence's members included) and, for a
    Replace, what it replaces: e.g. ["Sequence", "Replace:▁", "ByteFallback", "Fuse", "Strip"]."""
    if decoder is None:
        return []
    try:
        spec = json.loads(decoder.__getstate__())
    except Exception:  # an exotic decoder: go by its class name
        return [type(decoder).__name__]
    out: list[str] = []

    def walk(node: dict) -> None:
        kind = node.get("type", "")
        if kind == "Replace":
            pattern = node.get("pattern", {})
            kind += ":" + str(pattern.get("String", pattern.get("Regex", "")))
        out.append(kind)
        for child in node.get("decoders", []) or []:
            walk(child)

    walk(spec)
    return out


def token_scheme(backend: HFTokenizer) -> str:
    """How the backend's token strings map to bytes: one of SCHEMES (see the module docstring)."""
    types = _decoder_types(backend.decoder)
    if "ByteLevel" in types:
        return "byte_level"
    if "Metaspace" in types or "Replace:\u2581" in types:  # "▁" (U+2581) is a space
        return "metaspace"
    return "wordpiece"  # BERT's WordPiece decoder; also no decoder at all (tokens joined by spaces)


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
    """A thin wrapper around a `tokenizers.Tokenizer`, with the checkpoint's special tokens."""

    def __init__(self, backend: HFTokenizer, special: SpecialTokens | None = None):
        # a tokenizer.json may pad and truncate every text (sentence-transformers' pad to 128):
        # texts are framed, padded and measured against the context by their callers instead
        backend.no_padding()
        backend.no_truncation()
        self.backend = backend
        self.special_tokens = special or SpecialTokens()
        self._token_bytes: dict[int, bytes] = {}
        self._display: dict[int, str] = {}
        st = self.special_tokens
        # the end of a text: the named EOS, else attnlens' own <|endoftext|> (None if neither); BOS
        # likewise (attnlens' tokenizers, like GPT-2's, call <|endoftext|> both)
        self.eos_id = backend.token_to_id(st.eos) if st.eos else backend.token_to_id(EOS_TOKEN)
        self.bos_id = backend.token_to_id(st.bos) if st.bos else (
            None if st.carried else backend.token_to_id(EOS_TOKEN))
        # None when this tokenizer has no such token (a decoder's tokenizer)
        self.pad_id = backend.token_to_id(PAD_TOKEN)
        self.cls_id = backend.token_to_id(CLS_TOKEN)
        self.sep_id = backend.token_to_id(SEP_TOKEN)
        self.mask_id = backend.token_to_id(MASK_TOKEN)
        # Byte-level BPE (ours, GPT-2's, Llama 3's) maps tokens to bytes exactly; SentencePiece-style
        # tokens map "▁" to a space and <0xNN> to a byte; an imported WordPiece (BERT's) tokenizer is
        # shown by its token text ("##" continuation, else a new word).
        self.scheme = token_scheme(backend)
        self.byte_fallback = bool(getattr(backend.model, "byte_fallback", False))

    @property
    def byte_level(self) -> bool:
        return self.scheme == "byte_level"

    @property
    def chat_template(self) -> str | None:
        """tokenizer_config.json's `chat_template` (Jinja, rendered as transformers'
        apply_chat_template does; it names bos_token / eos_token), or None."""
        return self.special_tokens.chat_template

    @property
    def bos_token(self) -> str | None:
        return self.backend.id_to_token(self.bos_id) if self.bos_id is not None else None

    @property
    def eos_token(self) -> str | None:
        return self.backend.id_to_token(self.eos_id) if self.eos_id is not None else None

    @property
    def template_tokens(self) -> dict[str, str]:
        """The special tokens by the names a chat template uses: bos_token, eos_token (and pad_token,
        unk_token when named), as transformers' apply_chat_template passes them."""
        st = self.special_tokens
        unk = st.unk if st.carried else self.eos_token  # attnlens' own: <|endoftext|> is unk too
        names = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": st.pad, "unk_token": unk}
        return {k: v for k, v in names.items() if v is not None}

    @functools.cached_property
    def add_bos(self) -> bool:
        """Whether a prompt starts with BOS (tokenizer_config.json's add_bos_token; else whether the
        tokenizer.json's post-processor puts BOS first, as transformers' tokenizer(text) would)."""
        if self.special_tokens.add_bos is not None:
            return self.special_tokens.add_bos and self.bos_id is not None
        if self.bos_id is None:
            return False
        probe = self.backend.encode("a", add_special_tokens=True).ids
        return bool(probe) and probe[0] == self.bos_id

    @functools.cached_property
    def eos_ids(self) -> frozenset[int]:
        """Every id that ends a generation: EOS and generation_config.json's other eos ids."""
        ids = {i for i in self.special_tokens.stop_ids if 0 <= i < self.vocab_size}
        if self.eos_id is not None:
            ids.add(self.eos_id)
        return frozenset(ids)

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
    def from_file(cls, path: str | Path, special: SpecialTokens | None = None) -> "Tokenizer":
        return cls(HFTokenizer.from_file(str(path)), special)

    @classmethod
    def from_dir(cls, directory: str | Path, model_config: dict | None = None) -> "Tokenizer":
        """tokenizer.json of a directory with its special tokens (read_special_tokens). An EOS that
        only the model's config.json gives, by id, is looked up in the vocabulary (so generation
        still stops there); BOS is only ever what the tokenizer's files name, as for transformers."""
        d = Path(directory)
        special = read_special_tokens(d, model_config)
        backend = HFTokenizer.from_file(str(d / "tokenizer.json"))
        eos_ids = _ids((model_config or {}).get("eos_token_id"))
        if special.eos is None and eos_ids and backend.id_to_token(eos_ids[0]) is not None:
            special = replace(special, eos=backend.id_to_token(eos_ids[0]))
        return cls(backend, special)

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
        """special_tokens_map.json and tokenizer_config.json (and, when other ids than EOS end a
        generation, generation_config.json) for a directory that also holds tokenizer.json, so
        `transformers.AutoTokenizer` loads it with its special tokens. attnlens' own tokenizers
        name the end-of-text token bos/eos/unk (pad left unset), as GPT-2's do; an imported one
        keeps what it came with: its special tokens, add_bos_token and chat_template."""
        st = self.special_tokens
        if not st.carried:
            special = {"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "unk_token": EOS_TOKEN} \
                if self.eos_id is not None else {}
            config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": context_length,
                      "add_prefix_space": False, "clean_up_tokenization_spaces": False, **special}
            return {"special_tokens_map.json": special, "tokenizer_config.json": config}
        special = {f"{key}_token": getattr(st, key) for key in ("bos", "eos", "pad", "unk") if getattr(st, key)}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": context_length,
                  "clean_up_tokenization_spaces": False, **special}
        if st.add_bos is not None:
            config["add_bos_token"] = st.add_bos
        if st.chat_template is not None:
            config["chat_template"] = st.chat_template
        files: dict[str, dict] = {"special_tokens_map.json": special, "tokenizer_config.json": config}
        stops = sorted(self.eos_ids)
        if self.eos_id is not None and len(stops) > 1:
            stops.remove(self.eos_id)
            files["generation_config.json"] = {
                **({"bos_token_id": self.bos_id} if self.bos_id is not None else {}),
                "eos_token_id": [self.eos_id, *stops]}
        return files

    def to_str(self) -> str:
        return self.backend.to_str()

    # --- use ---------------------------------------------------------------
    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of every special token (BOS, EOS and the encoder's), never masked or predicted."""
        ids = (self.bos_id, self.eos_id, self.pad_id, self.cls_id, self.sep_id, self.mask_id)
        return frozenset(i for i in ids if i is not None)

    @property
    def has_encoder_tokens(self) -> bool:
        return None not in (self.pad_id, self.cls_id, self.sep_id, self.mask_id)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def frame_ids(self) -> tuple[int, int]:
        """([CLS], [SEP]): the ids an encoder's text is framed with; only an encoder's tokenizer has them."""
        assert self.cls_id is not None and self.sep_id is not None, "this tokenizer has no [CLS] and [SEP]"
        return self.cls_id, self.sep_id

    @property
    def prompt_prefix(self) -> list[int]:
        """What a prompt starts with: [BOS] where the tokenizer adds one (add_bos), else nothing."""
        return [self.bos_id] if self.add_bos and self.bos_id is not None else []  # add_bos implies a BOS id

    def encode(self, text: str) -> list[int]:
        """The ids of `text` alone: no special token added (a special token's text in `text` is it)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """The ids a prompt is fed as: BOS first when the tokenizer says so (`add_bos`: Llama,
        Mistral), as transformers' tokenizer(text) gives them, then `encode(text)`. A chat
        template's rendered text names BOS itself: encode that with `encode`."""
        ids = self.encode(text)
        return [*self.prompt_prefix, *ids] if self.add_bos else ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Exact text for ids; a trailing partial character decodes as U+FFFD. (SentencePiece-style:
        the space the tokenizer put before the text is taken off again, as transformers does.)"""
        if not self.byte_level:
            return self.backend.decode(list(ids), skip_special_tokens=False)
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (a SentencePiece-style word start with its space)."""
        cached = self._token_bytes.get(token_id)
        if cached is None:
            token = self.backend.id_to_token(int(token_id))
            if token is None:
                raise KeyError(f"token id {token_id} is not in the vocabulary")
            if token == EOS_TOKEN or token in self._special_tokens():
                cached = token.encode("utf-8")
            elif self.scheme == "byte_level":
                table = unicode_to_byte()
                cached = bytes(table[c] for c in token) if all(c in table for c in token) else token.encode("utf-8")
            elif self.scheme == "metaspace":
                byte = _BYTE_TOKEN.fullmatch(token) if self.byte_fallback else None
                cached = bytes([int(byte.group(1), 16)]) if byte else token.replace("\u2581", " ").encode("utf-8")
            else:
                cached = (token[2:] if token.startswith("##") else " " + token).encode("utf-8")
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
        """Added tokens that stand for their own text: the special ones, and any added token
        that is not normalised (a chat marker such as <|im_start|> in a byte-level vocabulary)."""
        added = self.backend.get_added_tokens_decoder() if hasattr(self.backend, "get_added_tokens_decoder") else {}
        return frozenset(t.content for t in added.values()
                         if getattr(t, "special", False) or not getattr(t, "normalized", True))

    def _special_tokens(self) -> frozenset[str]:
        return self._special_set
