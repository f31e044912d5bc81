"""Names stay whole: the checked names, how they are found, and the bundled tokenizers."""

from __future__ import annotations

from helpers import REPO_ROOT

from attnlens.model.data.names import (
    FREQUENT_HEADINGS,
    N_HEADINGS,
    TITLE_CHARACTERS,
    name_forms,
    names,
    speaker_headings,
    token_counts,
    tokenizer_texts,
)
from attnlens.model.data.passages import load_works
from attnlens.model.tokenizer import Tokenizer

DATA = REPO_ROOT / "data" / "shakespeare"


def test_speaker_headings_are_counted_case_folded_between_a_blank_line_and_a_speech():
    text = "ACT I.\n\nROMEO.\nO, she doth teach.\n\nRomeo.\nAgain.\n\nSIR TOBY.\n[Sings.]\n\nO, no heading.\nx\n"
    assert speaker_headings([text]) == {"ROMEO": 2}


def test_frequent_headings_are_the_corpus_own():
    counts = speaker_headings([w.text for w in load_works(DATA)])
    assert list(FREQUENT_HEADINGS) == [name for name, _ in counts.most_common(N_HEADINGS)]
    assert "SIR TOBY" in FREQUENT_HEADINGS  # the example, from a held-out work
    assert len(names()) == len({n.upper() for n in TITLE_CHARACTERS} | set(FREQUENT_HEADINGS))


def test_forms_are_capitals_and_ordinary_case_at_line_start_and_after_a_space():
    assert name_forms("SIR TOBY") == ["SIR TOBY", " SIR TOBY", "Sir Toby", " Sir Toby"]


def test_weighting_the_names_in_the_tokenizer_texts_is_what_keeps_them_whole():
    texts = [w.text for w in load_works(DATA) if w.split == "train"][:4]
    plain = token_counts(Tokenizer.train(texts, 1024))
    weighted = token_counts(Tokenizer.train(texts + tokenizer_texts(300), 1024))
    assert max(plain.values()) > 2
    assert max(weighted.values()) <= 2
    assert tokenizer_texts(0) == []
