"""The translator's data: the pairs the issue names, the held-out rule, no held-out pair trained on."""

from __future__ import annotations

import hashlib

import torch
from translator_helpers import small_translation_tokenizer

from attnlens.model.data.translation_pairs import (
    DATE_FORMATS,
    N_DAYS,
    date_pair,
    held_out_sample,
    is_held_out,
    number_pair,
    sample_training_pairs,
    tokenizer_corpus,
)
from attnlens.model.training.train_translation import IGNORE, encode_pairs


def test_pairs_are_the_ones_the_issue_names():
    day = (__import__("datetime").date(2021, 3, 3) - __import__("datetime").date(1900, 1, 1)).days
    assert date_pair(day, "full")[1:] == ("Wednesday, March 3, 2021", "mercredi 3 mars 2021")
    assert date_pair(day, "medium")[1:] == ("Mar 3, 2021", "3 mars 2021")
    assert date_pair(day, "long")[1:] == ("March 3, 2021", "3 mars 2021")
    assert number_pair(97)[1:] == ("ninety-seven", "quatre-vingt-dix-sept")
    assert date_pair(0, "full").source == "Monday, January 1, 1900"
    assert date_pair(N_DAYS - 1, "medium").source == "Dec 31, 2099"
    assert number_pair(999_999).target == "neuf cent quatre-vingt-dix-neuf mille neuf cent quatre-vingt-dix-neuf"


def test_held_out_rule_is_sha256_mod_10():
    for text in ["ninety-seven", "Mar 3, 2021", "one", "two", "zero"]:
        want = int(hashlib.sha256(text.encode()).hexdigest(), 16) % 10 == 0
        assert is_held_out(text) == want
    # about one number in ten is held out
    sources = [number_pair(n).source for n in range(0, 1_000_000, 331)]
    share = sum(map(is_held_out, sources)) / len(sources)
    assert 0.08 < share < 0.12


def test_training_draws_never_include_a_held_out_pair_and_are_deterministic():
    pairs = sample_training_pairs(3000, torch.Generator().manual_seed(5))
    assert not any(is_held_out(p.source) for p in pairs)
    kinds = [p.kind for p in pairs]
    assert 0.4 < kinds.count("date") / len(kinds) < 0.6
    assert pairs[:50] == sample_training_pairs(50, torch.Generator().manual_seed(5))
    # short numbers are drawn often (their rules are the long numbers' parts)
    small = [p for p in pairs if p.kind == "number" and len(p.source.split()) <= 2]
    assert len(small) > 100
    # and the tokenizer never saw a held-out pair either
    assert not any(is_held_out(t) for t in tokenizer_corpus(step=211)[0::2])


def test_held_out_sample_is_held_out_distinct_and_a_prefix_of_larger_samples():
    for kind in ("date", "number"):
        pairs = held_out_sample(kind, 60)
        assert all(is_held_out(p.source) and p.kind == kind for p in pairs)
        assert len({p.source for p in pairs}) == 60
        assert held_out_sample(kind, 20) == pairs[:20]
    formats = {date_pair(0, f).source.count(",") for f in DATE_FORMATS}
    assert formats == {1, 2}


def test_encode_pairs_teacher_forcing_layout():
    tok = small_translation_tokenizer()
    pairs = [number_pair(97), number_pair(4)]
    source, source_keep, inputs, target_keep, labels = encode_pairs(tok, pairs)
    tgt0 = tok.encode(pairs[0].target)
    assert inputs[0, 0] == tok.eos_id and inputs[0, 1:len(tgt0) + 1].tolist() == tgt0
    assert labels[0, :len(tgt0) + 1].tolist() == tgt0 + [tok.eos_id]
    assert labels[1, len(tok.encode("quatre")) + 1:].eq(IGNORE).all()
    assert source_keep.sum(1).tolist() == [len(tok.encode(p.source)) for p in pairs]
    assert target_keep.sum(1).tolist() == [len(tok.encode(p.target)) + 1 for p in pairs]
    assert tok.decode(source[0, :int(source_keep[0].sum())].tolist()) == "ninety-seven"
