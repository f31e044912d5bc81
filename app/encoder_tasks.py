"""What the encoder's endpoints compute, on a loaded checkpoint (these run off the event loop).

Inputs are framed as BERT frames them: [CLS] text [SEP]. `[MASK]` written in the text is the
mask token (and takes the whitespace before it, see model/tokenizer.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from attnlens.model import Checkpoint
from attnlens.model.tokenizer import MASK_TOKEN

MASK_IN_TEXT = re.compile(r"\s*" + re.escape(MASK_TOKEN))


class TaskInputError(ValueError):
    """The text cannot be used for this task; `param` and `code` say why."""

    def __init__(self, message: str, *, param: str = "text", code: str = "invalid_text"):
        super().__init__(message)
        self.param, self.code = param, code


def framed_ids(ckpt: Checkpoint, text: str) -> list[int]:
    """[CLS] + tokens + [SEP], checked against the context length."""
    tok = ckpt.tokenizer
    body = tok.encode(text)
    if not body:
        raise TaskInputError("text encodes to no tokens", code="empty_text")
    limit = ckpt.config.context_length - 2
    if len(body) > limit:
        raise TaskInputError(f"text has {len(body)} tokens, more than the {limit} that fit in the model's "
                             f"context of {ckpt.config.context_length} with [CLS] and [SEP]",
                             code="context_length_exceeded")
    return [tok.cls_id, *body, tok.sep_id]


@dataclass
class Candidate:
    score: float
    token: int
    token_str: str
    sequence: str


def never_candidates(tok) -> list[int]:
    """Tokens never offered to fill a mask: every special token ([CLS], [SEP], [PAD], [MASK],
    an imported tokenizer's [UNK], the end-of-text token)."""
    added = tok.backend.get_added_tokens_decoder() if hasattr(tok.backend, "get_added_tokens_decoder") else {}
    return sorted(set(tok.special_ids) | {i for i, t in added.items() if getattr(t, "special", False)})


def filled_sequence(tok, text: str, span: tuple[int, int], token_str: str, ids: list[int], position: int,
                    candidate: int, single: bool) -> str:
    """The text with `candidate` in place of the mask at `position` (of `ids`, framed).

    As Hugging Face's pipeline builds it: the filled ids decoded by the tokenizer, so a
    WordPiece tokenizer's rules apply (a word token gets its space, a `##` piece joins the word
    before it). With one mask the special tokens are left out; with several, the other masks
    stay (the framing [CLS] / [SEP] never shows). Byte-level BPE decodes to exactly the text:
    there the candidate's bytes are put in place of the mask (with the whitespace it took),
    and every other mask stays as it was written."""
    if tok.byte_level:
        return text[: span[0]] + token_str + text[span[1]:]
    filled = list(ids)
    filled[position] = candidate
    if single:
        return tok.backend.decode(filled, skip_special_tokens=True)
    framing = {tok.cls_id, tok.sep_id, tok.pad_id}
    return tok.backend.decode([i for i in filled if i not in framing], skip_special_tokens=False)


@torch.no_grad()
def fill_mask(ckpt: Checkpoint, text: str, top_k: int, max_masks: int) -> list[list[Candidate]]:
    """Each [MASK]'s top_k candidates, as Hugging Face's fill-mask pipeline gives them: the score
    is the softmax over the whole vocabulary; special tokens are never candidates (the pipeline
    offers them; here they are skipped, the others keep their scores)."""
    tok, model = ckpt.tokenizer, ckpt.model
    ids = framed_ids(ckpt, text)
    positions = [i for i, t in enumerate(ids) if t == tok.mask_id]
    spans = [m.span() for m in MASK_IN_TEXT.finditer(text)]
    if not positions:
        raise TaskInputError(f"text has no {MASK_TOKEN}: write {MASK_TOKEN} where the model should fill in a token",
                             code="no_mask")
    if len(positions) > max_masks:
        raise TaskInputError(f"text has {len(positions)} {MASK_TOKEN} tokens; at most {max_masks} are allowed",
                             code="too_many_masks")
    assert len(spans) == len(positions), (spans, positions)
    device = model.tok_emb.weight.device
    logits = model(torch.tensor([ids], device=device), task="mlm").logits[0, positions].float()  # (M, V)
    probs = torch.softmax(logits[:, : tok.vocab_size], dim=-1)  # over the vocabulary, as the pipeline
    never = never_candidates(tok)
    ranked = probs.clone()
    ranked[:, never] = -1.0  # a special token is never an answer
    k = min(top_k, tok.vocab_size - len(never))
    top = torch.topk(ranked, k, dim=-1)
    out = []
    for span, position, scores, cands in zip(spans, positions, top.values.tolist(), top.indices.tolist()):
        row = []
        for score, cand in zip(scores, cands):
            token_str = tok.decode([cand])
            row.append(Candidate(score, cand, token_str, filled_sequence(tok, text, span, token_str, ids, position,
                                                                         cand, len(positions) == 1)))
        out.append(row)
    return out


@torch.no_grad()
def classify(ckpt: Checkpoint, text: str) -> list[tuple[str, float]]:
    model = ckpt.model
    ids = framed_ids(ckpt, text)
    device = model.tok_emb.weight.device
    logits = model(torch.tensor([ids], device=device), task="classify").logits[0].float()
    probs = torch.softmax(logits, dim=-1).tolist()
    return sorted(zip(ckpt.config.labels, probs), key=lambda p: -p[1])


@torch.no_grad()
def encoder_attention_maps(model, ids: list[int], layers: list[int], heads: list[int]):
    """(len(layers), len(heads), T, T) float32 numpy probabilities of the bidirectional encoder."""
    device = model.tok_emb.weight.device
    attn = model(torch.tensor([ids], device=device), return_attention=True, task="hidden").attentions
    stacked = torch.stack([attn[i][0] for i in layers])  # (L', H, T, T)
    return stacked[:, heads].float().cpu().numpy()


@torch.no_grad()
def classify_or_fill_warm_up(ckpt: Checkpoint) -> None:
    """One forward through the encoder's heads (start-up warm-up)."""
    tok = ckpt.tokenizer
    ids = torch.tensor([[tok.cls_id, tok.mask_id, tok.sep_id]], device=ckpt.model.tok_emb.weight.device)
    out = ckpt.model(ids, return_attention=True)
    if ckpt.config.labels:
        ckpt.model(ids, task="classify")
    assert out.logits.shape[-1] == ckpt.config.vocab_size
