"""The translator's task: English dates and numbers into French, generated offline.

Every pair is computed on the spot by two pinned packages, so nothing is downloaded and
the data are the same on every machine:

    dates    1900-01-01 .. 2099-12-31, formats full | long | medium:
             babel.dates.format_date(d, format=F, locale="en")  ->  the same with locale="fr"
             "Wednesday, March 3, 2021" -> "mercredi 3 mars 2021";  "Mar 3, 2021" -> "3 mars 2021"
    numbers  0 .. 999,999:  num2words(n, lang="en")  ->  num2words(n, lang="fr")
             "ninety-seven" -> "quatre-vingt-dix-sept"

A pair is held out exactly when int(sha256(source).hexdigest(), 16) % 10 == 0 (`is_held_out`).
Training draws only pairs that are not held out (`sample_training_pairs` rejects the others);
evaluation reads only held-out ones (`held_out_sample`).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
from typing import NamedTuple

import torch

from attnlens.model.tokenizer import Tokenizer

FIRST_DATE = datetime.date(1900, 1, 1)
LAST_DATE = datetime.date(2099, 12, 31)
N_DAYS = (LAST_DATE - FIRST_DATE).days + 1  # 73,049
DATE_FORMATS = ("full", "long", "medium")
N_NUMBERS = 1_000_000  # 0 .. 999,999
KINDS = ("date", "number")


class Pair(NamedTuple):
    kind: str  # "date" | "number"
    source: str  # English
    target: str  # French


def is_held_out(source: str) -> bool:
    """The held-out rule of issue 10: one source in ten, fixed by its SHA-256."""
    return int(hashlib.sha256(source.encode()).hexdigest(), 16) % 10 == 0


def date_pair(day: int, fmt: str) -> Pair:
    """The pair for FIRST_DATE + `day` days in babel format `fmt`."""
    from babel.dates import format_date

    d = FIRST_DATE + datetime.timedelta(days=day)
    return Pair("date", format_date(d, format=fmt, locale="en"), format_date(d, format=fmt, locale="fr"))


@functools.lru_cache(maxsize=65536)
def number_pair(n: int) -> Pair:
    from num2words import num2words

    return Pair("number", num2words(n, lang="en"), num2words(n, lang="fr"))


def random_number(g: torch.Generator) -> int:
    """A number in 0 .. 999,999: half uniform, half with a uniform count of digits (1-6),
    so that the short numbers whose rules the long ones reuse ("et un", "quatre-vingts",
    "cents") are seen often, not once in a thousand draws."""
    if float(torch.rand((), generator=g)) < 0.5:
        return int(torch.randint(0, N_NUMBERS, (), generator=g))
    digits = int(torch.randint(1, 7, (), generator=g))
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return int(torch.randint(low, 10**digits, (), generator=g))


def random_pair(kind: str, g: torch.Generator) -> Pair:
    if kind == "date":
        day = int(torch.randint(0, N_DAYS, (), generator=g))
        fmt = DATE_FORMATS[int(torch.randint(0, len(DATE_FORMATS), (), generator=g))]
        return date_pair(day, fmt)
    return number_pair(random_number(g))


def sample_training_pairs(n: int, g: torch.Generator, date_fraction: float = 0.5) -> list[Pair]:
    """`n` pairs that are not held out, dates with probability `date_fraction`."""
    pairs: list[Pair] = []
    while len(pairs) < n:
        kind = "date" if float(torch.rand((), generator=g)) < date_fraction else "number"
        pair = random_pair(kind, g)
        if not is_held_out(pair.source):
            pairs.append(pair)
    return pairs


def held_out_sample(kind: str, n: int, seed: int = 0) -> list[Pair]:
    """`n` distinct held-out pairs of one kind, drawn uniformly from its held-out set.

    Dates: uniform over (day, format); numbers: uniform over 0 .. 999,999. Deterministic
    for a given seed (the report and its test use the same draws).
    """
    g = torch.Generator().manual_seed(seed * 7 + (0 if kind == "date" else 1))
    seen: set[str] = set()
    pairs: list[Pair] = []
    while len(pairs) < n:
        if kind == "date":
            day = int(torch.randint(0, N_DAYS, (), generator=g))
            pair = date_pair(day, DATE_FORMATS[int(torch.randint(0, 3, (), generator=g))])
        else:
            pair = number_pair(int(torch.randint(0, N_NUMBERS, (), generator=g)))
        if pair.source not in seen and is_held_out(pair.source):
            seen.add(pair.source)
            pairs.append(pair)
    return pairs


def tokenizer_corpus(step: int = 5) -> list[str]:
    """Texts the tokenizer is trained on: every `step`-th date in each format and every
    number below 1,000 plus a stride through the rest, both languages (the vocabulary is
    closed: month and day names, number words, digits). Held-out pairs are left out here too."""
    pairs = [date_pair(day, fmt) for day in range(0, N_DAYS, step) for fmt in DATE_FORMATS]
    pairs += [number_pair(n) for n in list(range(1000)) + list(range(1000, N_NUMBERS, 997))]
    return [text for pair in pairs if not is_held_out(pair.source) for text in pair[1:]]


def train_translation_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE on both languages' training texts (with [PAD] for padding): the tokenizer
    `attnlens train` makes for the translator (TrainingSpec tokenizer="translation")."""
    return Tokenizer.train(tokenizer_corpus(), vocab_size, encoder_tokens=True)


def all_held_out(kind: str) -> list[Pair]:
    """Every held-out pair of one kind (about 21,900 dates or 100,000 numbers; slow: it
    formats every candidate's source)."""
    if kind == "date":
        from babel.dates import format_date

        out = []
        for day in range(N_DAYS):
            d = FIRST_DATE + datetime.timedelta(days=day)
            for fmt in DATE_FORMATS:
                source = format_date(d, format=fmt, locale="en")
                if is_held_out(source):
                    out.append(Pair("date", source, format_date(d, format=fmt, locale="fr")))
        return out
    from num2words import num2words

    return [Pair("number", s, num2words(n, lang="fr"))
            for n, s in ((n, num2words(n, lang="en")) for n in range(N_NUMBERS)) if is_held_out(s)]
