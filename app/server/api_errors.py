"""Error responses: one exception type for our own errors, and the handlers that render
every error either natively ({"detail": ..., "param"?, "code"?}) or, under /v1, in OpenAI's shape
({"error": {"message", "type", "param", "code"}})."""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from attnlens.app.engine import EngineClosed, QueueFull, RequestTooLarge

log = logging.getLogger("attnlens.errors")

OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
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


def public_message(message: str) -> str:
    """What a client may see of an engine error: its own words for expected failures (e.g.
    shutting down), never the text of an internal exception (that is in the server log)."""
    return "internal error while generating (see the server log)" if message.startswith("internal error") else message


def field_error(field: str, message: str, kind: str = "value_error") -> RequestValidationError:
    """A 422 in exactly the shape of pydantic's own, for checks that need the settings."""
    loc = tuple(int(p) if p.isdigit() else p for p in field.split("."))  # "prompt.1" -> ("prompt", 1)
    return RequestValidationError([{"loc": ("body", *loc), "msg": message, "type": kind}])


class ErrorJSONResponse(JSONResponse):
    """An error body as ASCII JSON: a message may quote the client's own input, which can hold
    lone surrogates that have no UTF-8 form (escaped as \\udXXX they round-trip)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def is_openai(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def error_response(path: str, status: int, message: str, *, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None,
                   detail: Any = None) -> JSONResponse:
    body: dict[str, Any]
    if is_openai(path):
        body = {"error": {"message": message, "type": OPENAI_TYPES.get(status, "invalid_request_error"),
                          "param": param, "code": code}}
    else:
        body = {"detail": detail if detail is not None else message}
        if param:
            body["param"] = param  # the request field to fix, as in the /v1 shape
        if code:
            body["code"] = code
    return ErrorJSONResponse(body, status_code=status, headers=headers)


def scope_error_response(scope, status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """For ASGI middleware, which has a scope rather than a Request."""
    code = {401: "invalid_api_key", 413: "body_too_large"}.get(status)
    return error_response(scope.get("path", ""), status, message, code=code, headers=headers)


def body_parse_error(cause: BaseException | None) -> tuple[str, str]:
    """(message, code) for a JSON body FastAPI could not parse (its generic 400 says nothing of why)."""
    if isinstance(cause, RecursionError):
        return "the JSON body is nested too deeply to be read", "json_too_deep"
    if isinstance(cause, UnicodeDecodeError):
        return (f"the body is not valid UTF-8 (byte {cause.start}: {cause.reason}); JSON must be sent as UTF-8",
                "invalid_utf8")
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return ("a number in the JSON body has more digits than can be read (at most 4300); no field here takes "
                "such a number", "number_too_large")
    return "the body is not JSON that can be read", "invalid_json"


def _loc_name(loc) -> str:
    """`prompt.2` from pydantic's loc, without the union members' tags (`list[int]`, `str`, ...)."""
    parts = [str(p) for p in loc if p not in ("body", "query", "path")
             and (isinstance(p, int) or (p.isidentifier() and p not in _TYPE_TAGS))]
    return ".".join(parts) or "body"


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after"}


def _most_telling(errors: list[dict]) -> list[dict]:
    """For a field that may take several shapes (a union), pydantic reports one error per shape;
    a value check (e.g. a lone surrogate) says more than "should be a list" for the others."""
    checks = [e for e in errors if e.get("type") not in _SHAPE_ERRORS]
    return checks or errors


_SHAPE_ERRORS = {"string_type", "list_type", "int_type", "float_type", "bool_type", "dict_type", "none_required",
                 "model_type"}


def _said(error: dict) -> str:
    """A validation error's message; pydantic-core's for a text that is no Unicode says why."""
    if error.get("type") == "string_unicode":
        return "not valid Unicode: the text holds a lone surrogate (such as \\ud800), which encodes to no UTF-8"
    return error.get("msg", "")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        detail = [{"loc": list(e.get("loc", ())), "msg": _said(e), "type": e.get("type", "")} for e in errors]
        telling = _most_telling(detail)
        message = "; ".join(f"{_loc_name(e['loc'])}: {e['msg']}" for e in telling) or "invalid request"
        param = _loc_name(telling[0]["loc"]) if telling else None
        return error_response(request.url.path, 422, message, param=param, code="invalid_value",
                              detail=detail)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        if exc.status_code >= 500 and exc.status_code not in (502, 503, 504):
            ref = uuid.uuid4().hex[:12]  # the details go to the log, never to the client
            log.error("error %s on %s: %s", ref, request.url.path, exc.detail)
            return error_response(request.url.path, exc.status_code, f"internal error (reference {ref} in the "
                                  f"server log)", code=getattr(exc, "code", None) or "internal_error")
        if exc.status_code == 400 and not isinstance(exc, ApiError) and exc.__cause__ is not None:
            message, code = body_parse_error(exc.__cause__)  # FastAPI could not parse the body
            return error_response(request.url.path, 400, message, param="body", code=code)
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
        """Shutting down, or the model's engine is restarting (Retry-After) or failed: a 503 saying which."""
        headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
        return error_response(request.url.path, 503, str(exc), code=exc.code, headers=headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        ref = uuid.uuid4().hex[:12]
        log.exception("unhandled error %s on %s", ref, request.url.path)
        return error_response(request.url.path, 500, f"internal error (reference {ref} in the server log)",
                              code="internal_error")
