"""BERT's masked-LM corruption: pick 15% of the real tokens; of those, 80% become [MASK],
10% a random token, 10% stay as they are. The model is scored on every picked position."""

from __future__ import annotations

import torch

IGNORE = -100  # F.cross_entropy's ignore_index: positions that are not scored


def mask_tokens(
    ids: torch.Tensor,
    *,
    mask_id: int,
    special_ids: frozenset[int] | set[int],
    vocab_size: int,
    generator: torch.Generator,
    mask_prob: float = 0.15,
    replace_prob: float = 0.8,
    random_prob: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) for ids (B, T); labels are IGNORE except at the picked positions.

    Special tokens ([CLS], [SEP], [PAD], EOS) are never picked. Random replacements are drawn
    from the ordinary (non-special) tokens.
    """
    special = torch.tensor(sorted(special_ids), dtype=ids.dtype)
    candidates = ~torch.isin(ids, special)  # (B, T)
    picked = (torch.rand(ids.shape, generator=generator) < mask_prob) & candidates
    labels = torch.where(picked, ids, torch.full_like(ids, IGNORE))
    roll = torch.rand(ids.shape, generator=generator)
    to_mask = picked & (roll < replace_prob)
    to_random = picked & (roll >= replace_prob) & (roll < replace_prob + random_prob)
    inputs = ids.clone()
    inputs[to_mask] = mask_id
    if to_random.any():
        ordinary = torch.tensor(
            [i for i in range(vocab_size) if i not in special_ids], dtype=ids.dtype
        )
        draws = torch.randint(0, len(ordinary), (int(to_random.sum()),), generator=generator)
        inputs[to_random] = ordinary[draws]
    return inputs, labels


def word_edges(tokenizer, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(size,) booleans per token id: does its text start with a letter, does it end with one.

    A token continues the word of the token before it when it starts with a letter and that
    one ends with a letter (byte-level BPE puts the space before a word into the word's first
    token: " wherefore" is one word, " where" + "fore" too). Special tokens are neither.
    """
    starts = torch.zeros(size, dtype=torch.bool)
    ends = torch.zeros(size, dtype=torch.bool)
    for i in range(tokenizer.vocab_size):
        if i in tokenizer.special_ids:
            continue
        text = tokenizer.token_bytes(i).decode("utf-8", errors="replace")
        starts[i] = text[:1].isalpha()
        ends[i] = text[-1:].isalpha()
    return starts, ends


def mask_words(
    ids: torch.Tensor,
    *,
    edges: tuple[torch.Tensor, torch.Tensor],
    mask_id: int,
    special_ids: frozenset[int] | set[int],
    vocab_size: int,
    generator: torch.Generator,
    mask_prob: float = 0.15,
    replace_prob: float = 0.8,
    random_prob: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole-word masking: `mask_tokens` with the choices made per word, not per token.

    A word (a run of tokens that continue each other, `word_edges`) is picked with
    `mask_prob`; every token of a picked word is scored, and all of them become [MASK] (80%),
    random tokens (10%) or stay (10%) together. A model can then no longer fill "fore" from
    the " where" beside it: it has to know the word.
    """
    starts_letter, ends_letter = edges
    B, T = ids.shape
    special = torch.tensor(sorted(special_ids), dtype=ids.dtype)
    candidates = ~torch.isin(ids, special)  # (B, T)
    continues = torch.zeros(B, T, dtype=torch.bool)
    continues[:, 1:] = starts_letter[ids[:, 1:]] & ends_letter[ids[:, :-1]]
    position = torch.arange(T).expand(B, T)
    word_start = torch.where(continues, torch.zeros_like(position), position).cummax(dim=1).values  # (B, T)
    pick = torch.rand(ids.shape, generator=generator) < mask_prob  # decided at each word's start
    roll = torch.rand(ids.shape, generator=generator)
    picked = pick.gather(1, word_start) & candidates
    roll = roll.gather(1, word_start)
    labels = torch.where(picked, ids, torch.full_like(ids, IGNORE))
    to_mask = picked & (roll < replace_prob)
    to_random = picked & (roll >= replace_prob) & (roll < replace_prob + random_prob)
    inputs = ids.clone()
    inputs[to_mask] = mask_id
    if to_random.any():
        ordinary = torch.tensor([i for i in range(vocab_size) if i not in special_ids], dtype=ids.dtype)
        draws = torch.randint(0, len(ordinary), (int(to_random.sum()),), generator=generator)
        inputs[to_random] = ordinary[draws]
    return inputs, labels
