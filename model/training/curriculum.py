"""A copying curriculum for the decoder: some training rows repeat a span of their own text.

Induction heads (Olsson et al. 2022: attend to the token after the previous occurrence of the
current token, and copy it) form in language models once predicting from an earlier
occurrence pays. In a few million tokens of plays that happens rarely and late: a name or a
refrain recurs, but most text does not. Here a share of the rows (`share`) is a window of the
corpus in which one span of its own text, `min_span` .. `max_span` tokens long, is written
again later in the same row:

    window  a b c d e f g h i j ...      span s .. s+l-1, inserted at j >= s + l
    row     a b c d e f | c d e | g h i  (still block + 1 tokens: the window's tail is cut)

The second copy is predictable only by copying. Every row stays real text (a passage read
twice), the loss is the ordinary next-token loss over the whole row, and the held-out works
are never read. Rows are drawn from a generator seeded by (seed, step, rank) like
`batch_at`'s, so a resumed run sees the same batches.
"""

from __future__ import annotations

import torch


def repeat_span(window: torch.Tensor, generator: torch.Generator, min_span: int, max_span: int) -> torch.Tensor:
    """`window` (N,) with one of its spans written again later; the result is N tokens long."""
    n = len(window)
    max_span = min(max_span, n // 2)
    min_span = min(min_span, max_span)
    span = int(torch.randint(min_span, max_span + 1, (1,), generator=generator))
    start = int(torch.randint(0, n - 2 * span + 1, (1,), generator=generator))  # first copy
    at = int(torch.randint(start + span, n - span + 1, (1,), generator=generator))  # second copy
    return torch.cat([window[:at], window[start : start + span], window[at : n - span]])


def batch_with_repeats(stream: torch.Tensor, step: int, rank: int, batch_size: int, block: int, seed: int, *,
                       share: float, min_span: int, max_span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) (B, block) like train.batch_at's, with about `share` of the rows repeating a span."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
    starts = torch.randint(0, len(stream) - block - 1, (batch_size,), generator=g)
    repeat = torch.rand(batch_size, generator=g) < share
    windows = []
    for s, r in zip(starts.tolist(), repeat.tolist()):
        window = stream[s : s + block + 1]
        windows.append(repeat_span(window, g, min_span, max_span) if r else window)
    rows = torch.stack(windows)  # (B, block + 1)
    return rows[:, :-1], rows[:, 1:]
