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
