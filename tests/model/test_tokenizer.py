"""Byte-level BPE: exact round trips on tricky Unicode and honest per-token display texts."""

from __future__ import annotations

import pytest

from attnlens.model.tokenizer import EOS_TOKEN, Tokenizer, byte_to_unicode, bytes_for_display, unicode_to_byte

TRICKY = [
    "Café naïve résumé",  # precomposed accents
    "東京タワーと日本語",  # CJK
    "emoji 😀🎭!",  # 4-byte characters
    "family 👩\u200d👩\u200d👧\u200d👦 and flag 🏳️\u200d🌈",  # ZWJ sequences, variation selector
    "e\u0301 a\u0308 n\u0303",  # combining marks
    "line one\nline two\n\n",  # newlines
    "   leading spaces",
    "windows\r\nline",
    "tab\there\t\tx",
    "mixed: Ω≈ç √ ∫ 😀\u200d",  # a dangling ZWJ
]


@pytest.fixture(scope="module")
def rich() -> Tokenizer:
    """Trained on the tricky texts themselves: every character is learned whole."""
    return Tokenizer.train(TRICKY * 10, vocab_size=600)


@pytest.fixture(scope="module")
def ascii_only() -> Tokenizer:
    """Never saw a non-ASCII character: those fall apart into single-byte tokens."""
    return Tokenizer.train(["the quick brown fox jumps over the lazy dog, again and again. "] * 20, vocab_size=280)


def is_whole_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.parametrize("text", TRICKY)
def test_round_trip_is_exact(rich, ascii_only, text):
    for tok in (rich, ascii_only):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.decode_bytes(ids) == text.encode("utf-8")
        assert tok.backend.decode(ids) == text  # the library's own decoder agrees


@pytest.mark.parametrize("text", TRICKY)
def test_display_texts_concatenate_to_the_text_when_tokens_are_whole_characters(rich, text):
    ids = rich.encode(text)
    assert all(is_whole_utf8(rich.token_bytes(i)) for i in ids)  # precondition of this test
    shown = rich.display_texts(ids)
    assert "".join(shown) == text
    assert not any("<0x" in s for s in shown)


def test_display_text_keeps_spaces_newlines_tabs_and_carriage_returns(rich):
    shown = rich.display_texts(rich.encode("windows\r\nline"))
    assert "\r" in shown and "\n" in shown
    assert rich.display_texts(rich.encode("tab\there"))[1] == "\t"
    assert rich.display_texts(rich.encode("line one"))[1] == " one"
    assert rich.display_texts(rich.encode("line two\n\n"))[-1] == "\n\n"


def test_display_text_of_a_partial_multibyte_character_shows_bytes(ascii_only):
    ids = ascii_only.encode("東")  # U+6771 = E6 9D B1, never seen in training
    assert ascii_only.display_texts(ids) == ["<0xE6>", "<0x9D>", "<0xB1>"]
    assert ascii_only.decode(ids) == "東"
    assert ascii_only.decode(ids[:2]) == "\ufffd"  # a trailing fragment decodes as U+FFFD
    ids = ascii_only.encode("café")
    shown = ascii_only.display_texts(ids)
    assert shown[-2:] == ["<0xC3>", "<0xA9>"]  # é = C3 A9
    assert "".join(shown) != "café"
    assert ascii_only.decode(ids) == "café"
    emoji = ascii_only.display_texts(ascii_only.encode("😀"))  # F0 9F 98 80
    assert "".join(emoji) == "<0xF0><0x9F><0x98><0x80>"


def test_display_text_of_a_merged_token_with_a_fragment():
    """A learned token can hold whole characters plus part of one: only the part is shown as bytes."""
    tok = Tokenizer.train(["xy\u6771 "] * 50, vocab_size=260)  # merges: xy, E6 9D, xy+E6 9D; stops there
    ids = tok.encode("xy\u6771")
    assert [tok.token_bytes(i) for i in ids] == [b"xy\xe6\x9d", b"\xb1"]
    assert tok.display_texts(ids) == ["xy<0xE6><0x9D>", "<0xB1>"]
    assert tok.decode(ids) == "xy\u6771"


def test_bytes_for_display():
    # the pure function, on hand-made byte strings
    assert bytes_for_display(b"ab\xe6\x9d") == "ab<0xE6><0x9D>"
    assert bytes_for_display(b"\xb1cd") == "<0xB1>cd"
    assert bytes_for_display("東京".encode()) == "東京"
    assert bytes_for_display(b"\xf0\x9f\x98\x80") == "😀"
    assert bytes_for_display(b"\xf0\x9f\x98") == "<0xF0><0x9F><0x98>"
    assert bytes_for_display(b"\xff") == "<0xFF>"
    assert bytes_for_display(b"") == ""


def test_eos_is_one_special_token(rich):
    assert rich.eos_id is not None
    assert rich.encode(EOS_TOKEN) == [rich.eos_id]
    assert rich.encode("a" + EOS_TOKEN + "b")[1:-1] == [rich.eos_id]
    assert rich.display_text(rich.eos_id) == EOS_TOKEN
    assert rich.decode([rich.eos_id]) == EOS_TOKEN


def test_unknown_id_raises_key_error(rich):
    with pytest.raises(KeyError, match="not in the vocabulary"):
        rich.token_bytes(rich.vocab_size + 5)


def test_byte_map_is_a_bijection_over_printable_characters():
    table = byte_to_unicode()
    assert len(table) == 256 and len(set(table.values())) == 256
    assert all(c.isprintable() and not c.isspace() for c in table.values())
    assert all(unicode_to_byte()[c] == b for b, c in table.items())
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ"  # GPT-2's well-known choices


def test_save_load_and_string_round_trip(rich, tmp_path):
    rich.save(tmp_path / "tokenizer.json")
    for other in (Tokenizer.from_file(tmp_path / "tokenizer.json"), Tokenizer.from_str(rich.to_str())):
        assert other.vocab_size == rich.vocab_size
        assert other.eos_id == rich.eos_id
        for text in TRICKY:
            assert other.encode(text) == rich.encode(text)
            assert other.display_texts(other.encode(text)) == rich.display_texts(rich.encode(text))


def test_from_vocab_merges_matches_the_tokenizer_json(rich, tmp_path):
    rich.backend.model.save(str(tmp_path))  # writes vocab.json and merges.txt, GPT-2's original layout
    other = Tokenizer.from_vocab_merges(tmp_path / "vocab.json", tmp_path / "merges.txt")
    assert other.eos_id == rich.eos_id
    for text in TRICKY + [EOS_TOKEN + " after"]:
        assert other.encode(text) == rich.encode(text)
        assert other.decode(other.encode(text)) == text


def test_encode_batch_matches_encode(rich):
    assert rich.encode_batch(TRICKY) == [rich.encode(t) for t in TRICKY]
