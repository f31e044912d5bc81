"""Serving OpenAI's embeddings: POST /v1/embeddings, for every encoder (a family that declares the
`embeddings` task: model/families/encoder.py).

Each text is framed as the encoder reads a text elsewhere ([CLS] text [SEP], as /classify and
/fill-mask frame it) and the model's sentence embedding is its hidden states pooled as its config
says (`pooling` "mean": over the real positions, [CLS] and [SEP] included; "cls": the first
position), then L2-normalised: what a sentence-transformers model's Transformer, Pooling and
Normalize modules give (Encoder.sentence_embeddings). The texts are checked (their count, then
each one's bytes), tokenised together off the event loop, checked against the context (an
over-long text is a 400 naming its index, as OpenAI refuses one; nothing is truncated), then run
on the model's runner (ATTNLENS_MAX_ENCODER_CONCURRENT forwards at once) as one EmbedCall
(model/analysis/encoder_outputs.py): right-padded batches of similar lengths, each with its
attention mask, so padding never changes a vector.

EmbeddingsServing answers POST /v1/embeddings (app/api/embeddings_routes.py is the thin router).
"""

from __future__ import annotations

import base64

import numpy as np

from attnlens.app.api.openai_schemas import EmbeddingRequest
from attnlens.app.registry.model_registry import ServedModel
from attnlens.app.server.api_errors import ApiError
from attnlens.app.server.state import AppState
from attnlens.app.serving.prompts import check_text_bytes, tokenize_texts
from attnlens.model.analysis.operations import EmbedCall


def check_request(body: EmbeddingRequest, served: ServedModel, max_inputs: int) -> list[str]:
    """The texts to embed, once the request's options and count are ones this server can answer."""
    width = served.checkpoint.config.d_model
    if body.dimensions is not None and body.dimensions != width:
        raise ApiError(400, f"dimensions is {body.dimensions}, but {served.describe()} gives {width}-dimensional "
                            f"embeddings and cannot shorten them: leave dimensions out or set it to {width}",
                       param="dimensions", code="invalid_value")
    texts = body.texts
    if texts is None:
        raise ApiError(400, "input as token ids is not supported: each model here reads its own tokenizer's "
                            "ids, which a client's tokenizer (e.g. tiktoken) does not give; send the text "
                            "(LangChain's OpenAIEmbeddings: check_embedding_ctx_length=False)",
                       param="input", code="unsupported")
    if len(texts) > max_inputs:
        raise ApiError(400, f"input holds {len(texts)} texts, more than the limit of {max_inputs} in one request "
                            "(ATTNLENS_MAX_EMBEDDING_INPUTS): send them in several requests",
                       param="input", code="too_many_inputs")
    return texts


async def framed_inputs(body: EmbeddingRequest, served: ServedModel, texts: list[str]) -> list[list[int]]:
    """[CLS] + tokens + [SEP] of each text: every text checked by its bytes first, then all
    tokenised together off the event loop, then each checked against the model's context."""
    ckpt = served.checkpoint
    tok, context = ckpt.tokenizer, ckpt.config.context_length
    limit = context - 2
    fields = [f"input.{i}" if body.many else "input" for i in range(len(texts))]
    where = f"the context of {context} tokens of {served.describe()}, with [CLS] and [SEP]"
    for field, text in zip(fields, texts):
        check_text_bytes(tok, text, limit, field=field, limit_name=where)
    rows = await tokenize_texts(tok, texts)
    for field, ids in zip(fields, rows):
        if len(ids) > limit:
            raise ApiError(400, f"{field} has {len(ids)} tokens, more than the {limit} that fit in {where}; "
                                "send a shorter text (nothing is truncated)",
                           param=field, code="context_length_exceeded")
    cls, sep = tok.frame_ids
    return [[cls, *ids, sep] for ids in rows]


def encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """One embedding as OpenAI sends it: a list of numbers, or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


class EmbeddingsServing:
    """Answers POST /v1/embeddings for the encoders in `state`."""

    def __init__(self, state: AppState):
        self.state = state

    async def create(self, body: EmbeddingRequest, served: ServedModel) -> dict:
        """OpenAI's embedding list for the request from `served` (the encoder app/api/deps.py found
        for it): one unit vector per input, in input order."""
        texts = check_request(body, served, self.state.settings.max_embedding_inputs)
        rows = await framed_inputs(body, served, texts)
        tok = served.checkpoint.tokenizer
        pad = tok.pad_id if tok.pad_id is not None else 0  # padded positions are masked: any id will do
        vectors = await served.runner.call(EmbedCall(rows=rows, pad_id=pad))
        tokens = sum(map(len, rows))
        return {"object": "list", "model": served.name,
                "data": [{"object": "embedding", "index": i, "embedding": encoded(v, body.encoding_format)}
                         for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
