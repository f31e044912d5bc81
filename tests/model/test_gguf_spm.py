"""GGUF files with a SentencePiece tokenizer (`tokenizer.ggml.model` "llama": Llama 2, TinyLlama,
Mistral, Gemma, Phi-3), rebuilt as a BPE that merges by score (model/interop/gguf_tokenizer.py),
against two references that build nothing of ours:

- the `sentencepiece` library, on a BPE model it trains here (tests/spm_helpers.py) and whose
  pieces, scores and types are the file's: the ids of every line of The Tempest and of awkward
  texts (runs of spaces, leading spaces, newlines, digits, accents, CJK, emoji by byte fallback),
  with the space prefix (Llama) and without (Gemma); with whole tokens in the text, llama.cpp's
  tokenize loop (cut them out, encode each piece of text alone) around that library;
- transformers' own GGUF tokenizer (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`) on the
  same files, a llama one and a gemma2 one.
"""

from __future__ import annotations

import pytest

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from helpers import write_gguf  # noqa: E402
from spm_helpers import (  # noqa: E402
    CONTROL,
    USER_DEFINED,
    llama_cpp_ids,
    shakespeare,
    spm_vocab,
    train_sentencepiece,
)

from attnlens.model.checkpoint import CheckpointError  # noqa: E402
from attnlens.model.interop.gguf_file import metadata, open_reader  # noqa: E402
from attnlens.model.interop.gguf_tokenizer import tokenizer_from_metadata  # noqa: E402

AWKWARD = ["  two leading spaces", " one leading space", " ", "   ", "", "trailing  ", "a\nb\n\nc", "\n\nnewlines first",
           "tabs\tand\t\tmore", "1234567890 42 3.14159 1,000,000", "日本語 🤗 emoji 🎭👍🏽", "héllo wörld çà señor",
           "x  y   z    w     v", "Ωμέγα русский עברית ﷺ", "don't it's WE'LL", "the the thee thou thine",
           "Ça coûte 12,50 € à Zürich", "ｆｕｌｌｗｉｄｔｈ ＡＢＣ", "null\x00byte and \x7f del", "e\u0301 combining"]
# whole tokens appended as llama.cpp's converter appends added tokens: control and user-defined
ADDED = (("<|im_start|>", CONTROL), ("<|im_end|>", CONTROL), ("<end_of_turn>", CONTROL),
         ("<tool>", USER_DEFINED), ("\u2581\u2581", USER_DEFINED))
WHOLE = ["<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", "hello<|im_start|>world", "a<tool>b <tool> c",
         "<s>The</s> <unk>", "x  y", "   three", "<end_of_turn><end_of_turn> end", "<tool>", "<|im_end|>  ",
         "no whole token here", " <s> lead"]


def tempest_texts() -> list[str]:
    """Every line of The Tempest, and every run of five lines joined by newlines."""
    lines = shakespeare("tempest").splitlines()
    return lines + ["\n".join(lines[i:i + 5]) for i in range(0, len(lines), 5)]


def ours(vocab):
    return tokenizer_from_metadata(vocab.metadata(), "spm.gguf")


@pytest.mark.parametrize("prefix", [True, False], ids=["space-prefix", "no-prefix"])
def test_ids_equal_the_sentencepiece_library_and_decode_back(prefix):
    sp = train_sentencepiece(prefix)
    tok = ours(spm_vocab(sp, add_space_prefix=prefix))
    texts = tempest_texts() + AWKWARD
    assert len(texts) > 3000
    mismatched = [t for t in texts if tok.encode(t) != sp.encode(t)]
    assert mismatched == []
    assert [t for t in texts if tok.decode(tok.encode(t)) != t] == []
    # the texts reach byte fallback (emoji, fullwidth letters) and pieces of whole words
    ids = [i for t in AWKWARD for i in tok.encode(t)]
    assert any(sp.is_byte(i) for i in ids) and any(len(sp.id_to_piece(i)) > 3 for i in ids)


@pytest.mark.parametrize("prefix", [True, False], ids=["space-prefix", "no-prefix"])
def test_whole_tokens_cut_the_text_as_llama_cpp_does(prefix):
    """Control, unknown and user-defined tokens stay whole (parse_special), and with the space
    prefix each piece of text after one starts with "▁" too (llama.cpp: is_prev_special)."""
    sp = train_sentencepiece(prefix)
    vocab = spm_vocab(sp, add_space_prefix=prefix, added=ADDED)
    tok = ours(vocab)
    texts = WHOLE + AWKWARD + tempest_texts()[:300]
    assert [t for t in texts if tok.encode(t) != llama_cpp_ids(sp, vocab, t)] == []
    user, control = vocab.tokens.index("<tool>"), vocab.tokens.index("<|im_start|>")
    assert tok.encode("a<tool>b")[1] == user and tok.encode("x<|im_start|>")[-1] == control
    assert tok.display_texts(tok.encode("<|im_start|>user"))[0] == "<|im_start|>"


def spm_files(tmp_path):
    """A llama file with the space prefix and a gemma2 file without it, as released files are."""
    from test_gguf_more import write_model_gguf

    llama, gemma = tmp_path / "llama" / "model.gguf", tmp_path / "gemma2" / "model.gguf"
    for path in (llama, gemma):
        path.parent.mkdir()
    write_gguf(llama, qtype="F32", spm=spm_vocab(train_sentencepiece(True), add_space_prefix=True))
    write_model_gguf("gemma2", gemma, "F32", spm=spm_vocab(train_sentencepiece(False), add_space_prefix=False))
    return {"llama": (llama, True), "gemma2": (gemma, False)}


def test_ids_equal_transformers_gguf_tokenizer(tmp_path):
    """transformers' tokenizer from the same files gives the same ids, except that its Metaspace
    adds no "▁" in front of a text that starts with a space (where the library and llama.cpp do)."""
    texts = tempest_texts()[:1500] + AWKWARD
    for arch, (path, prefix) in spm_files(tmp_path).items():
        tok = tokenizer_from_metadata(metadata(open_reader(path)), path)
        hf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        differ = [t for t in texts if tok.encode(t) != hf(t, add_special_tokens=False)["input_ids"]]
        assert all(prefix and t.startswith(" ") for t in differ), (arch, differ[:5])
        sp = train_sentencepiece(prefix)
        assert all(tok.encode(t) == sp.encode(t) for t in differ)
        assert tok.encode_prompt("To be") == hf("To be")["input_ids"]  # <bos> first, as both say
        assert (tok.bos_token, tok.eos_token, tok.add_bos) == ("<s>", "</s>", True)


def test_defaults_special_ids_and_stops_are_llama_cpps():
    """A file that names no BOS/EOS/unknown id nor add_bos gets llama.cpp's SPM defaults (1, 2, 0,
    BOS added); tokens llama.cpp stops at by their text (<end_of_turn>, <|im_end|>) end a generation."""
    vocab = spm_vocab(train_sentencepiece(True), add_space_prefix=True, added=ADDED)
    meta = {k: v for k, v in vocab.metadata().items() if not k.endswith("_token_id") and "add_bos" not in k}
    tok = tokenizer_from_metadata(meta, "spm.gguf")
    assert (tok.bos_id, tok.eos_id, tok.special_tokens.unk, tok.add_bos) == (1, 2, "<unk>", True)
    assert tok.eos_ids == {2, vocab.tokens.index("<|im_end|>"), vocab.tokens.index("<end_of_turn>")}
    gemma = tokenizer_from_metadata({**meta, "tokenizer.ggml.add_bos_token": False}, "spm.gguf")
    assert gemma.encode_prompt("hi") == gemma.encode("hi")


def test_phi3_whole_tokens_take_the_whitespace_after_them():
    """llama.cpp strips the whitespace after a Phi-3 file's whole tokens (not after <s>)."""
    vocab = spm_vocab(train_sentencepiece(True), add_space_prefix=True, added=(("<|user|>", CONTROL),))
    phi3 = tokenizer_from_metadata({**vocab.metadata(), "general.name": "Phi-3-mini-4k-instruct"}, "phi3.gguf")
    plain = tokenizer_from_metadata(vocab.metadata(), "llama.gguf")
    assert phi3.encode("<|user|>\n  hi") == phi3.encode("<|user|>hi") == plain.encode("<|user|>hi")
    assert plain.encode("<|user|>\n  hi") != plain.encode("<|user|>hi")
    assert phi3.encode("<s>\nhi") == plain.encode("<s>\nhi")


def test_a_sentencepiece_file_without_scores_or_another_model_is_refused():
    meta = spm_vocab(train_sentencepiece(True), add_space_prefix=True).metadata()
    with pytest.raises(CheckpointError, match="'tokenizer.ggml.scores' is missing"):
        tokenizer_from_metadata({k: v for k, v in meta.items() if k != "tokenizer.ggml.scores"}, "x.gguf")
    with pytest.raises(CheckpointError, match="tokenizer model 't5' is not supported"):
        tokenizer_from_metadata({**meta, "tokenizer.ggml.model": "t5"}, "x.gguf")
