"""OpenAI-compatible legacy completions: POST /v1/completions, GET /v1/models and
GET /v1/models/{model}.

`model` names one of the loaded models that generate (GET /v1/models; none = the default
model); an unknown name is a 404 `model_not_found` listing those, an encoder a 400.
`logit_bias`, `presence_penalty` and `frequency_penalty` act as in vLLM (per choice, over the
tokens that choice generated; log-probabilities stay the model's own); `best_of` generates
that many choices per prompt and returns the `n` with the highest log-probability per token;
`suffix` is refused (400). Differences from OpenAI, on purpose: `n` (or `best_of`) > 1 with a
seed uses seed, seed + 1, ... for the choices so they differ yet repeat; a streamed `echo`
sends the prompt text first but no logprobs for the prompt tokens.

A list of prompts is counted before any is tokenised (prompts x choices that could never fit
in the server's places are a 400 at once), and the strings are tokenised together on a
worker thread that lets go of the GIL (the serving side is app/serving/openai_serving.py).
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from attnlens.app.api.deps import CompletionsModel, ListedModel, RegistryDep, StateDep
from attnlens.app.api.openai_schemas import Completion, ModelCard, ModelList
from attnlens.app.registry.model_registry import COMPLETIONS, ServedModel
from attnlens.app.serving.openai_serving import ERRORS, CompletionsServing, stream_description

router = APIRouter(prefix="/v1", tags=["openai"])


@router.post("/completions", response_model=Completion, response_model_exclude_none=False,
             responses={**ERRORS, 200: stream_description("Completion", "a Completion whose choices carry the "
                                                                        "new text")})
async def completions(asked: CompletionsModel, request: Request, state: StateDep):
    return await CompletionsServing(state).create(asked.body, asked.served, request)


def _card(served: ServedModel) -> dict:
    path = served.path
    created = int(path.stat().st_mtime) if path is not None and path.exists() else 0
    return {"id": served.name, "object": "model", "created": created, "owned_by": "attnlens"}


@router.get("/models", response_model=ModelList, responses=ERRORS)
async def models(registry: RegistryDep):
    """The models that generate (decoders, encoder-decoders); GET /models lists every loaded model."""
    return {"object": "list", "data": [_card(m) for m in registry.models.values() if COMPLETIONS in m.tasks]}


@router.get("/models/{model}", response_model=ModelCard, responses=ERRORS)
async def model_card(served: ListedModel):
    """One model of GET /v1/models (OpenAI's models.retrieve); a model /v1 cannot use is a 404."""
    return _card(served)
