"""Operations: liveness, readiness, what is loaded, and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from attnlens.app.api.deps import AnyModel, SettingsDep, StateDep
from attnlens.app.api.ops_schemas import Health, ModelInfo, Readiness, SamplingDefaultsInfo
from attnlens.app.server.middleware import CONTENT_TYPE_LATEST
from attnlens.model.placement import weights_label

router = APIRouter(tags=["operations"])

REPORT_KEYS = ("steps", "tokens_seen", "wall_time_s", "hardware", "final_train_loss", "final_val_loss",
               "val_loss", "val_bits_per_byte", "train_loss", "best_val_loss", "dataset", "config_name")


@router.get("/healthz", response_model=Health)
async def healthz():
    """The process is alive and its event loop answers (no model work involved)."""
    return {"status": "ok"}


def model_states(registry) -> dict[str, dict]:
    """Each model's engine state, restarts and (when it does not run) why: /readyz and /models say it."""
    out = {}
    for name, served in registry.models.items():
        sup = served.supervisor
        out[name] = {"state": served.state, "restarts": sup.restarts if sup is not None else 0,
                     "detail": sup.detail if sup is not None else None}
    return out


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
async def readyz(state: StateDep):
    """200 once every model is loaded and warmed up and every engine runs (thread or process);
    else 503, with each model's state (a restarting or failed engine says why)."""
    registry = state.registry
    if not state.ready or registry is None:
        return JSONResponse({"ready": False, "status": state.status, "detail": None}, status_code=503)
    models = model_states(registry)
    down = {name: m for name, m in models.items() if m["state"] != "running"}
    if not down:
        return {"ready": True, "status": "ready", "models": models}
    status = "failed" if any(m["state"] == "failed" for m in down.values()) else "restarting"
    detail = "; ".join(f"model {name!r}: {m['detail'] or m['state']}" for name, m in down.items())
    return JSONResponse({"ready": False, "status": status, "detail": detail, "models": models}, status_code=503)


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
async def model_info(served: AnyModel, s: SettingsDep):
    """The default model, or the loaded model named by `?model=` (GET /models lists them)."""
    ckpt, name = served.checkpoint, served.name
    cfg = ckpt.config
    return {
        "name": name,
        "path": name,  # the directory's name: the server's file system stays private
        "architecture": cfg.to_dict(),
        "parameters": ckpt.model.num_parameters(),
        "parameters_without_embeddings": ckpt.model.num_parameters(exclude_embeddings=True),
        "device": str(ckpt.weights_device),
        "dtype": str(ckpt.model.dtype).removeprefix("torch."),
        "weights": weights_label(ckpt, s.dtype),
        "context_length": cfg.context_length,
        "vocab_size": cfg.vocab_size,
        "tokenizer_vocab_size": ckpt.tokenizer.vocab_size,
        "training": training_summary(ckpt.report),
        "limits": {"max_prompt_tokens": s.max_prompt_tokens, "max_new_tokens": s.max_new_tokens,
                   "max_concurrent": s.max_concurrent, "max_queue": s.max_queue,
                   "max_attention_concurrent": s.max_attention_concurrent,
                   "max_body_bytes": s.max_body_bytes},
        "sampling_defaults": SamplingDefaultsInfo.of(served.sampling),
    }


@router.get("/metrics", response_class=Response)
async def metrics(state: StateDep):
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
