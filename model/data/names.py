"""The character names a user types, and how the tokenizer is taught to keep them whole.

A speaker heading is a line holding only a name and a full stop, after a blank line (or at
the start of a work) and before the first line of the speech: "JULIET." in some editions,
"Romeo." or the abbreviation "Ham." in others. `speaker_headings` counts them over the works,
case-folded, so "KING." and "King." are one heading.

The names whose token counts the tests check (`NAMES`) are the title characters and the
`N_HEADINGS` most frequent headings of the whole corpus, held-out works included (Twelfth
Night's "SIR TOBY" is one of them: a user may type any of them). `FREQUENT_HEADINGS` is that
list as `speaker_headings` computes it on data/shakespeare (a test recomputes it). It is 40
long, ten more than the 30 that the issue asks for, so that a slightly different definition
of a heading (e.g. one that also counts headings followed by a stage direction) is still
covered.

Each name is checked in four forms: capitals and ordinary case, at the start of a line (a
heading, "ROMEO") and after a space (" Romeo" in a sentence, " ROMEO" in a stage
direction). Byte-level BPE only learns a merge for a string frequent enough in its training
texts; `tokenizer_texts` gives the tokenizer's trainer (never the model) the names' words
`weight` times, so that every form becomes one token per word.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Iterable

# The list of title characters, in ordinary case.
TITLE_CHARACTERS = (
    "Romeo", "Juliet", "Hamlet", "Macbeth", "Othello", "Lear", "Prospero", "Cleopatra",
    "Antony", "Brutus", "Falstaff", "Portia", "Titus", "Timon", "Coriolanus",
)

N_HEADINGS = 40

# speaker_headings(every work in data/shakespeare).most_common(N_HEADINGS), names only.
FREQUENT_HEADINGS = (
    "KING", "DUKE", "HAM", "CLOWN", "FALSTAFF", "BRUTUS", "GLOSTER", "PRINCE", "IAGO", "OTHELLO",
    "ANTONY", "KING RICHARD", "KING HENRY", "TIMON", "CLEOPATRA", "ROSALIND", "YORK", "LEAR",
    "WARWICK", "QUEEN", "MENENIUS", "ANTONIO", "DESDEMONA", "ROMEO", "BEROWNE", "CLAUDIO",
    "MESSENGER", "PETRUCHIO", "PANDARUS", "CRESSIDA", "VALENTINE", "SIR TOBY", "FAL", "PROTEUS",
    "CORIOLANUS", "PAROLLES", "MACBETH", "CAESAR", "CASSIUS", "SUFFOLK",
)

_HEADING = re.compile(r"[A-Z][A-Za-z'\- ]*[A-Za-z]\.")


def speaker_headings(texts: Iterable[str]) -> Counter:
    """Upper-cased heading name -> how many speeches it opens, over `texts`."""
    counts: Counter = Counter()
    for text in texts:
        lines = text.split("\n")
        for i, line in enumerate(lines[:-1]):
            if (_HEADING.fullmatch(line) and (i == 0 or lines[i - 1] == "")
                    and lines[i + 1] != "" and not lines[i + 1].startswith("[")):
                counts[line[:-1].upper()] += 1
    return counts


def ordinary_case(name: str) -> str:
    """"SIR TOBY" -> "Sir Toby"."""
    return " ".join(word.capitalize() for word in name.split(" "))


def names() -> list[str]:
    """Every checked name once, in capitals, sorted: title characters and frequent headings."""
    return sorted({n.upper() for n in TITLE_CHARACTERS} | set(FREQUENT_HEADINGS))


def name_forms(name: str) -> list[str]:
    """The four strings a name is checked as (see the module docstring)."""
    capitals, ordinary = name.upper(), ordinary_case(name)
    return [capitals, " " + capitals, ordinary, " " + ordinary]


def tokenizer_texts(weight: int) -> list[str]:
    """Extra training texts for the tokenizer: each word of each name's forms, at the start of
    a line and after a space, `weight` times over (no texts for weight 0)."""
    if weight <= 0:
        return []
    words = sorted({word for name in names() for form in name_forms(name) for word in form.split(" ") if word})
    block = "\n".join(f"{word} {word}" for word in words) + "\n"
    return [block] * weight


def token_counts(tokenizer, checked: Iterable[str] | None = None) -> dict[str, int]:
    """form -> number of tokens, for every form of every checked name."""
    return {form: len(tokenizer.encode(form)) for name in (checked or names()) for form in name_forms(name)}
