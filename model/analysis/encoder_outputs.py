"""An encoder's task outputs on the model's side, from token ids the service framed ([CLS] text
[SEP]); the service tokenises, picks what to leave out and turns ids back into text.

    mask_scores          each masked position's top-k ids and their probabilities (fill-mask)
    class_probabilities  every label's probability, in the config's label order (classify)
    length_batches       inputs in batches of similar lengths, bounded in padded positions
    embed_rows           (N, C) unit sentence embeddings, run in right-padded batches
    encoder_attention_maps  (L', H', T, T) bidirectional maps of one sequence
    encoder_warm_up      one forward through the encoder's heads (start-up)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from attnlens.model.data.passages import pad_rows

MAX_BATCH_TOKENS = 8192  # padded positions in one forward (at least one input a forward, whatever its length)


@dataclass
class MaskScores:
    """Per masked position (in the order asked), the top-k candidate ids and their probabilities
    (a softmax over the whole vocabulary)."""

    ids: list[list[int]]  # (M, k)
    scores: list[list[float]]  # (M, k)


@torch.no_grad()
def mask_scores(model, ids: list[int], positions: list[int], vocab_size: int, never: list[int],
                top_k: int) -> MaskScores:
    """The masked-LM head's top_k tokens at each of `positions`, as Hugging Face's fill-mask pipeline
    scores them: the softmax over the tokenizer's `vocab_size` tokens; the `never` ids (special
    tokens) are skipped, the others keep their scores."""
    device = model.device
    logits = model(torch.tensor([ids], device=device), task="mlm").logits[0, positions].float()  # (M, V)
    probs = torch.softmax(logits[:, :vocab_size], dim=-1)  # over the vocabulary, as the pipeline
    ranked = probs.clone()
    ranked[:, never] = -1.0  # a special token is never an answer
    top = torch.topk(ranked, top_k, dim=-1)
    return MaskScores(top.indices.tolist(), top.values.tolist())


@torch.no_grad()
def class_probabilities(model, ids: list[int]) -> list[float]:
    """The classification head's softmax over the labels (the config's order)."""
    device = model.device
    logits = model(torch.tensor([ids], device=device), task="classify").logits[0].float()
    return torch.softmax(logits, dim=-1).tolist()


def length_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices of the inputs in batches of similar lengths (longest first), each at most
    `max_tokens` padded positions (rows x its longest) unless one input alone is longer."""
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


@torch.inference_mode()
def embed_rows(model, rows: list[list[int]], pad_id: int, max_tokens: int = MAX_BATCH_TOKENS,
               report: Callable[[], None] | None = None) -> np.ndarray:
    """(N, C) float32 unit vectors of the framed `rows`, in their order; padded positions (`pad_id`:
    any id will do, they are masked) never change a vector. `report` before each batch: a caller
    that went away stops there."""
    device = model.device
    out = np.empty((len(rows), model.config.d_model), dtype=np.float32)
    for batch in length_batches([len(r) for r in rows], max_tokens):
        if report is not None:
            report()
        ids, mask = pad_rows([rows[i] for i in batch], pad_id)
        out[batch] = model.sentence_embeddings(ids.to(device), mask.to(device)).cpu().numpy()  # (b, C)
    return out


@torch.no_grad()
def encoder_attention_maps(model, ids: list[int], layers: list[int], heads: list[int]) -> np.ndarray:
    """(len(layers), len(heads), T, T) float32 numpy probabilities of the bidirectional encoder."""
    device = model.device
    attn = model(torch.tensor([ids], device=device), return_attention=True, task="hidden").attentions
    stacked = torch.stack([attn[i][0] for i in layers])  # (L', H, T, T)
    return stacked[:, heads].float().cpu().numpy()


@torch.no_grad()
def encoder_warm_up(model, ids: list[int]) -> None:
    """One forward through the encoder's heads ([CLS] [MASK] [SEP]): the masked-LM head's and, for
    a classifier, the classification head's."""
    inputs = torch.tensor([ids], device=model.device)
    out = model(inputs, return_attention=True)
    if model.config.labels:
        model(inputs, task="classify")
    assert out.logits.shape[-1] == model.config.vocab_size
