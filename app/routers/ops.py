"""Operations: liveness, readiness, what is loaded, and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from ..deps import RegistryDep, StateDep
from ..metrics import CONTENT_TYPE_LATEST
from ..registry import ServedModel
from ..schemas import Health, ModelInfo, Readiness

router = APIRouter(tags=["operations"])

REPORT_KEYS = ("steps", "tokens_seen", "wall_time_s", "hardware", "final_train_loss", "final_val_loss",
               "val_loss", "val_bits_per_byte", "train_loss", "best_val_loss", "dataset", "config_name")


@router.get("/healthz", response_model=Health)
async def healthz():
    """The process is alive and its event loop answers (no model work involved)."""
    return {"status": "ok"}


def model_state(served: ServedModel) -> str:
    """ready, or why not (a generating model's engine, in a thread or a process of its own, has stopped)."""
    if served.generates and not served.runner.alive:
        return "the engine has stopped"
    return "ready"


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
async def readyz(state: StateDep):
    """200 once every model is loaded and warmed up and every engine runs; else 503, naming the models
    that are not ready."""
    if not state.ready or state.registry is None:
        return JSONResponse({"ready": False, "status": state.status}, status_code=503)
    models = {name: model_state(m) for name, m in state.registry.models.items()}
    down = [f"{name}: {s}" for name, s in models.items() if s != "ready"]
    if not down:
        return {"ready": True, "status": "ready", "models": models}
    return JSONResponse({"ready": False, "status": "failed", "detail": "; ".join(down), "models": models},
                        status_code=503)


def training_summary(report: dict | None) -> dict | None:
    if not report:
        return None
    picked = {k: report[k] for k in REPORT_KEYS if k in report}
    # keep any other scalar fields too; nested blobs (curves, configs) stay in the file
    for k, v in report.items():
        if k not in picked and isinstance(v, (int, float, str, bool)) and len(picked) < 40:
            picked[k] = v
    return picked


@router.get("/model", response_model=ModelInfo, responses={404: {"description": "unknown model"}})
async def model_info(registry: RegistryDep, state: StateDep, model: str | None = None):
    """The default model, or the loaded model named by `?model=` (GET /models lists them)."""
    served = registry.get(model)
    ckpt, name, s = served.checkpoint, served.name, state.settings
    cfg, weights = ckpt.config, ckpt.model.tok_emb.weight
    return {
        "name": name,
        "path": name,  # the directory's name: the server's file system stays private
        "architecture": cfg.to_dict(),
        "parameters": ckpt.model.num_parameters(),
        "parameters_without_embeddings": ckpt.model.num_parameters(exclude_embeddings=True),
        "device": str(weights.device),
        "dtype": str(weights.dtype).removeprefix("torch."),
        "context_length": cfg.context_length,
        "vocab_size": cfg.vocab_size,
        "tokenizer_vocab_size": ckpt.tokenizer.vocab_size,
        "training": training_summary(ckpt.report),
        "limits": {"max_prompt_tokens": s.max_prompt_tokens, "max_new_tokens": s.max_new_tokens,
                   "max_concurrent": s.max_concurrent, "max_queue": s.max_queue,
                   "max_attention_concurrent": s.max_attention_concurrent,
                   "max_body_bytes": s.max_body_bytes},
    }


@router.get("/metrics", response_class=Response)
async def metrics(state: StateDep):
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
