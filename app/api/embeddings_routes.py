"""OpenAI's embeddings: POST /v1/embeddings (the serving is app/serving/embeddings_serving.py).

`model` names a loaded encoder (GET /models lists `embeddings` in its tasks); none = the default
model, or the one loaded encoder. `input` is a string or a list of strings; each gets its unit
vector, pooled as the model's config says and L2-normalised, as a sentence-transformers model
gives it. `encoding_format` "base64" sends the little-endian float32 bytes, as OpenAI does.
"""

from __future__ import annotations

from fastapi import APIRouter

from attnlens.app.api.deps import EmbeddingModel, StateDep
from attnlens.app.api.openai_schemas import EmbeddingList
from attnlens.app.serving.embeddings_serving import EmbeddingsServing
from attnlens.app.serving.openai_serving import ERRORS

router = APIRouter(prefix="/v1", tags=["openai"])


@router.post("/embeddings", response_model=EmbeddingList, responses=ERRORS)
async def embeddings(asked: EmbeddingModel, state: StateDep):
    """Each input's sentence embedding from an encoder: its hidden states pooled (the mean over its
    tokens, or [CLS]) and L2-normalised."""
    return await EmbeddingsServing(state).create(asked.body, asked.served)
