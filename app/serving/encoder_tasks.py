"""The service's side of the encoder's tasks (these run off the event loop): a text framed and
checked, the model-side call made of it (model/analysis/operations.py: FillMaskCall,
ClassifyCall), and the answer made of the model's scores.

Inputs are framed as BERT frames them: [CLS] text [SEP]. `[MASK]` written in the text is the
mask token (and takes the whitespace before it, see model/tokenizer.py).

    framed_ids        [CLS] + tokens + [SEP], checked against the context
    fill_mask_call    the FillMaskCall of a text (its masks found and counted) and the masks' spans
    candidates        each mask's candidates from the model's MaskScores, as Hugging Face gives them
    ranked_labels     every label with its probability, highest first
    fill_mask, classify   all of it in one process (a loaded checkpoint, no server)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from attnlens.model import Checkpoint
from attnlens.model.analysis.encoder_outputs import MaskScores
from attnlens.model.analysis.operations import ClassifyCall, FillMaskCall, run_operation
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
    cls, sep = tok.frame_ids
    return [cls, *body, sep]


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


def fill_mask_call(ckpt: Checkpoint, text: str, top_k: int, max_masks: int
                   ) -> tuple[FillMaskCall, list[tuple[int, int]]]:
    """The model-side call that scores each [MASK] of `text` (at most `max_masks`), and each mask's
    span in the text. Special tokens are never candidates (the pipeline offers them; here they are
    skipped, the others keep their scores)."""
    tok = ckpt.tokenizer
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
    never = never_candidates(tok)
    k = min(top_k, tok.vocab_size - len(never))
    return FillMaskCall(ids=ids, positions=positions, vocab_size=tok.vocab_size, never=never, top_k=k), spans


def candidates(tok, text: str, call: FillMaskCall, spans: list[tuple[int, int]], scores: MaskScores
               ) -> list[list[Candidate]]:
    """Each [MASK]'s candidates, as Hugging Face's fill-mask pipeline gives them: the score is the
    softmax over the whole vocabulary, the sequence the text filled in."""
    out = []
    single = len(call.positions) == 1
    for span, position, row_scores, cands in zip(spans, call.positions, scores.scores, scores.ids):
        row = []
        for score, cand in zip(row_scores, cands):
            token_str = tok.decode([cand])
            row.append(Candidate(score, cand, token_str,
                                 filled_sequence(tok, text, span, token_str, call.ids, position, cand, single)))
        out.append(row)
    return out


def ranked_labels(labels: list[str], probs: list[float]) -> list[tuple[str, float]]:
    """Every label with its probability, highest first (Hugging Face's text-classification, top_k=None)."""
    return sorted(zip(labels, probs), key=lambda p: -p[1])


def fill_mask(ckpt: Checkpoint, text: str, top_k: int, max_masks: int) -> list[list[Candidate]]:
    """Each [MASK]'s top_k candidates, computed in this process (what POST /fill-mask answers)."""
    call, spans = fill_mask_call(ckpt, text, top_k, max_masks)
    return candidates(ckpt.tokenizer, text, call, spans, run_operation(ckpt.model, call))


def classify(ckpt: Checkpoint, text: str) -> list[tuple[str, float]]:
    """Every label's probability for `text`, highest first, computed in this process (POST /classify)."""
    return ranked_labels(ckpt.config.labels, run_operation(ckpt.model, ClassifyCall(framed_ids(ckpt, text))))
