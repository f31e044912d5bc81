"""Error responses: one exception type for our own errors, and the handlers that render
every error either natively ({"detail": ..., "param"?, "code"?}) or, under /v1, in OpenAI's shape
({"error": {"message", "type", "param", "code"}})."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from .engine import EngineClosed, QueueFull, RequestTooLarge

log = logging.getLogger("attnlens.errors")

OPENAI_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_exceeded",
    503: "server_error",
    500: "server_error",
}


class ApiError(HTTPException):
    """An error we raise on purpose: status, a message a person can act on, and optionally
    the offending parameter and a machine-readable code."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(status_code, message, headers=headers)
        self.param = param
        self.code = code


def field_error(field: str, message: str, kind: str = "value_error") -> RequestValidationError:
    """A 422 in exactly the shape of pydantic's own, for checks that need the settings."""
    return RequestValidationError([{"loc": ("body", field), "msg": message, "type": kind}])


def is_openai(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def error_response(path: str, status: int, message: str, *, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None,
                   detail: Any = None) -> JSONResponse:
    if is_openai(path):
        body = {"error": {"message": message, "type": OPENAI_TYPES.get(status, "invalid_request_error"),
                          "param": param, "code": code}}
    else:
        body = {"detail": detail if detail is not None else message}
        if param:
            body["param"] = param  # the request field to fix, as in the /v1 shape
        if code:
            body["code"] = code
    return JSONResponse(body, status_code=status, headers=headers)


def scope_error_response(scope, status: int, message: str) -> JSONResponse:
    """For ASGI middleware, which has a scope rather than a Request."""
    return error_response(scope.get("path", ""), status, message)


def _loc_name(loc) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    return ".".join(parts) or "body"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        detail = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
                  for e in errors]
        message = "; ".join(f"{_loc_name(e['loc'])}: {e['msg']}" for e in detail) or "invalid request"
        param = _loc_name(detail[0]["loc"]) if detail else None
        return error_response(request.url.path, 422, message, param=param, code="invalid_value",
                              detail=detail)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return error_response(request.url.path, exc.status_code, str(exc.detail),
                              param=getattr(exc, "param", None), code=getattr(exc, "code", None),
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(QueueFull)
    async def queue_full(request: Request, exc: QueueFull):
        request.app.state.attnlens.metrics.rejected.labels("queue_full").inc()
        return error_response(request.url.path, 429, str(exc), code="queue_full",
                              headers={"Retry-After": str(exc.retry_after)})

    @app.exception_handler(RequestTooLarge)
    async def request_too_large(request: Request, exc: RequestTooLarge):
        request.app.state.attnlens.metrics.rejected.labels("too_large").inc()
        return error_response(request.url.path, 400, str(exc), param=exc.param, code="too_many_generations")

    @app.exception_handler(EngineClosed)
    async def engine_closed(request: Request, exc: EngineClosed):
        return error_response(request.url.path, 503, str(exc), code="shutting_down")

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(request.url.path, 500, f"internal error: {type(exc).__name__}",
                              code="internal_error")
