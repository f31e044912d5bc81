"""SentencePiece tokenizers for GGUF tests: a small BPE model trained here by the `sentencepiece`
library itself (on the committed sonnets, deterministically), written into GGUF metadata the way
llama.cpp's converter writes one (tokenizer.ggml.model "llama": pieces, scores, token types, no
merges), and llama.cpp's tokenize loop around that library as the reference for whole tokens."""

from __future__ import annotations

import functools
import gzip
import io
from dataclasses import dataclass, field

import pytest
from helpers import REPO_ROOT

spm = pytest.importorskip("sentencepiece")

# beside the sonnets: characters the vocabulary should hold pieces of (accents, CJK, a currency sign)
EXTRA_LINES = ["Ça coûte 12,50 € à Zürich — naïve café", "日本語のテキストです", "Ünïcödé façade señor",
               "The year 1609, sonnets 1-154."]
# llama.cpp's token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
LLAMA2_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + m['content'] "
                   "+ ' [/INST]' }}{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}")


def shakespeare(name: str) -> str:
    return gzip.decompress((REPO_ROOT / "data" / "shakespeare" / f"{name}.txt.gz").read_bytes()).decode("utf-8")


@functools.lru_cache(maxsize=4)
def train_sentencepiece(add_dummy_prefix: bool, vocab_size: int = 600):
    """A BPE SentencePiece model as Llama 2's is set up (identity normalization, spaces kept,
    digits split, byte fallback, runs of spaces as pieces), trained on the sonnets in one thread."""
    lines = [line for line in shakespeare("sonnets").splitlines() if line.strip()] + EXTRA_LINES * 3
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=out, model_type="bpe", vocab_size=vocab_size,
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=add_dummy_prefix, split_digits=True,
        allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=out.getvalue())


def piece_type(sp, i: int) -> int:
    """llama.cpp's converter's type of piece i (_create_vocab_sentencepiece)."""
    if sp.is_unknown(i):
        return UNKNOWN
    if sp.is_control(i):
        return CONTROL
    if sp.is_unused(i):
        return UNUSED
    return BYTE if sp.is_byte(i) else NORMAL


@dataclass
class SpmVocab:
    """A SentencePiece tokenizer as GGUF metadata (what write_gguf writes for `spm=`)."""

    tokens: list[str]
    scores: list[float]
    types: list[int]
    add_space_prefix: bool = True
    add_bos: bool = True
    ids: dict[str, int] = field(default_factory=lambda: {"bos": 1, "eos": 2, "unk": 0})
    chat_template: str | None = LLAMA2_TEMPLATE

    def write(self, w) -> None:
        w.add_tokenizer_model("llama")
        w.add_token_list(self.tokens)
        w.add_token_scores(self.scores)
        w.add_token_types(self.types)
        w.add_bos_token_id(self.ids["bos"])
        w.add_eos_token_id(self.ids["eos"])
        w.add_unk_token_id(self.ids["unk"])
        w.add_add_bos_token(self.add_bos)
        w.add_add_space_prefix(self.add_space_prefix)
        if self.chat_template is not None:
            w.add_chat_template(self.chat_template)

    def metadata(self) -> dict:
        """The same as the dict gguf_file.metadata reads back."""
        meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": self.tokens,
                "tokenizer.ggml.scores": self.scores, "tokenizer.ggml.token_type": self.types,
                "tokenizer.ggml.add_bos_token": self.add_bos, "tokenizer.ggml.add_space_prefix": self.add_space_prefix,
                **{f"tokenizer.ggml.{'unknown' if k == 'unk' else k}_token_id": v for k, v in self.ids.items()}}
        return meta | ({"tokenizer.chat_template": self.chat_template} if self.chat_template else {})


def spm_vocab(sp, *, add_space_prefix: bool, added: tuple[tuple[str, int], ...] = ()) -> SpmVocab:
    """The model's pieces, scores and types, then `added` (token, type) after them as llama.cpp's
    converter appends added tokens (score -1000; a user-defined token's "▁" written as a space)."""
    n = sp.get_piece_size()
    tokens = [sp.id_to_piece(i) for i in range(n)] + [t.replace("\u2581", " ") if kind == USER_DEFINED else t
                                                       for t, kind in added]
    return SpmVocab(tokens, [sp.get_score(i) for i in range(n)] + [-1000.0] * len(added),
                    [piece_type(sp, i) for i in range(n)] + [kind for _, kind in added], add_space_prefix)


def llama_cpp_ids(sp, vocab: SpmVocab, text: str) -> list[int]:
    """llama.cpp's llama_vocab::tokenize(text, add_special=false, parse_special=true) for an SPM
    vocabulary, its SPM core being the library's (which llama.cpp ports): the control, unknown and
    user-defined tokens are cut out of the text, longest first (tokenizer_st_partition), and each
    piece of text between them is encoded alone, with the space prefix when the file says so."""
    whole = sorted((i for i, kind in enumerate(vocab.types) if kind in (UNKNOWN, CONTROL, USER_DEFINED)),
                   key=lambda i: -len(vocab.tokens[i]))
    fragments: list[str | int] = [text] if text else []
    for i in whole:
        fragments = [part for f in fragments for part in _split_on(f, vocab.tokens[i], i)]
    return [i for f in fragments for i in ([f] if isinstance(f, int) else sp.encode(f))]


def _split_on(fragment: str | int, token: str, token_id: int) -> list[str | int]:
    if isinstance(fragment, int):
        return [fragment]
    parts = fragment.split(token)
    out: list[str | int] = []
    for k, part in enumerate(parts):
        out += ([token_id] if k else []) + ([part] if part else [])
    return out
