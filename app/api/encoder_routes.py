"""The model list and the encoder's tasks: GET /models, POST /fill-mask, POST /classify (the tasks'
serving side is app/serving/encoder_serving.py)."""

from __future__ import annotations

from fastapi import APIRouter

from attnlens.app.api.deps import ClassifyModel, FillMaskModel, RegistryDep
from attnlens.app.api.encoder_schemas import (
    ClassifyResponse,
    FillMaskResponse,
    ModelsResponse,
    ModelSummary,
)
from attnlens.app.api.ops_schemas import SamplingDefaultsInfo
from attnlens.app.registry.model_registry import CLASSIFY, EMBEDDINGS, ServedModel
from attnlens.app.serving.encoder_serving import EncoderServing

router = APIRouter(tags=["models", "encoder"])


def summary(served: ServedModel, default: str) -> ModelSummary:
    cfg, family = served.checkpoint.config, served.family
    return ModelSummary(
        name=served.name, family=family.name, family_info=family.describe(), default=served.name == default,
        n_layers=cfg.n_layers, n_heads=cfg.n_heads, d_model=cfg.d_model, context_length=cfg.context_length,
        vocab_size=cfg.vocab_size, parameters=served.checkpoint.model.num_parameters(), memory=served.memory(),
        tasks=served.tasks, attention=family.attention_kind,
        labels=served.labels, head_figures=served.head_figures, classifier_layers=getattr(cfg, "classifier_layers", 0), pooling=cfg.pooling if {CLASSIFY, EMBEDDINGS} & set(served.tasks) else None,
        state=served.state, restarts=served.supervisor.restarts if served.supervisor is not None else 0,
        detail=served.supervisor.detail if served.supervisor is not None else None,
        sampling_defaults=SamplingDefaultsInfo.of(served.sampling),
    )


@router.get("/models", response_model=ModelsResponse)
async def list_models(registry: RegistryDep) -> ModelsResponse:
    """Every loaded model: its family, size, the tasks it answers and, for a classifier, its labels."""
    return ModelsResponse(default=registry.default,
                          models=[summary(m, registry.default) for m in registry.models.values()])


@router.post("/fill-mask", response_model=FillMaskResponse,
             responses={400: {"description": "no [MASK], too long (by its bytes, before tokenising, or by its "
                                             "tokens), or a model that cannot fill masks"},
                        404: {"description": "unknown model"}, 429: {}, 503: {}})
async def fill_mask_route(asked: FillMaskModel) -> FillMaskResponse:
    """The top-k tokens for each `[MASK]` in `text`, as Hugging Face's fill-mask pipeline gives them."""
    return await EncoderServing().fill_mask(asked.body, asked.served)


@router.post("/classify", response_model=ClassifyResponse,
             responses={400: {"description": "too long, or a model without a classification head"},
                        404: {"description": "unknown model"}, 429: {}, 503: {}})
async def classify_route(asked: ClassifyModel) -> ClassifyResponse:
    """Every label's probability for `text`, highest first (Hugging Face's text-classification, top_k=None)."""
    return await EncoderServing().classify(asked.body, asked.served)
