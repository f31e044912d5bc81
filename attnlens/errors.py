"""The exceptions attnlens.Client raises: one per kind of failure, each carrying what the server said.

    AttnlensError
      APIConnectionError        no HTTP answer: the server is down, unreachable, or too slow
      StreamError               a stream's `event: error` (the generation failed on the server)
      APIError                  an HTTP error answer: status, message, param, code, detail
        BadRequestError         400 (and 422 below it): the request is wrong, `param` names the field
          ValidationError       422: a field fails the schema (`detail` is pydantic's list)
        AuthenticationError     401 / 403: no or a wrong API key
        NotFoundError           404: e.g. an unknown model (the message lists the loaded ones)
        RequestTimeoutError     408
        PayloadTooLargeError    413
        RateLimitError          429: `retry_after` is the server's Retry-After, in seconds
        ServiceUnavailableError 503: not ready yet; `retry_after` too
        InternalServerError     any other 5xx
"""

from __future__ import annotations

from typing import Any

import httpx


class AttnlensError(Exception):
    """Every error attnlens.Client raises."""


class APIConnectionError(AttnlensError):
    """No HTTP answer came back (connection refused, DNS, timeout)."""


class StreamError(AttnlensError):
    """The server ended a stream with an `event: error`: the generation failed there."""


class APIError(AttnlensError):
    """An error answer: `status`, the server's `message`, the request field to fix (`param`),
    a machine-readable `code`, the raw `detail` and, for 429 / 503, `retry_after` seconds."""

    def __init__(self, message: str, *, status: int, param: str | None = None, code: str | None = None,
                 detail: Any = None, retry_after: float | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.detail = detail
        self.retry_after = retry_after
        self.headers = headers or {}

    def __str__(self) -> str:
        where = f" [{self.param}]" if self.param else ""
        code = f" ({self.code})" if self.code else ""
        return f"{self.status}{code}{where}: {self.message}"


class BadRequestError(APIError):
    """400 or 422: the request is wrong; `param` names the field."""


class ValidationError(BadRequestError):
    """422: a field fails the schema; `detail` is the list of {loc, msg, type}."""


class AuthenticationError(APIError):
    """401 / 403: the server wants an API key (Client(api_key=...)) or refused this one."""


class NotFoundError(APIError):
    """404: e.g. a model the server has not loaded."""


class RequestTimeoutError(APIError):
    """408: the server gave up reading the request."""


class PayloadTooLargeError(APIError):
    """413: the request body is over the server's MAX_BODY_BYTES."""


class RateLimitError(APIError):
    """429: too many requests at once; wait `retry_after` seconds."""


class ServiceUnavailableError(APIError):
    """503: the server is not ready (loading, warming up) or its engine stopped."""


class InternalServerError(APIError):
    """A 5xx other than 503."""


_BY_STATUS = {400: BadRequestError, 401: AuthenticationError, 403: AuthenticationError, 404: NotFoundError,
              408: RequestTimeoutError, 413: PayloadTooLargeError, 422: ValidationError, 429: RateLimitError,
              503: ServiceUnavailableError}


def describe_detail(detail: Any) -> str:
    """The server's `detail` as one line: a message, or pydantic's list as `field: msg; ...`."""
    if detail is None:
        return ""
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list):
        parts = []
        for d in detail:
            if not isinstance(d, dict):
                parts.append(str(d))
                continue
            field = ".".join(str(p) for p in d.get("loc", []) if p != "body")
            msg = str(d.get("msg", "")).removeprefix("Value error, ")
            parts.append(f"{field}: {msg}" if field else msg)
        return "; ".join(parts)
    return str(detail)


def retry_after_seconds(value: str | None) -> float | None:
    """Retry-After as seconds (the server sends a number; an HTTP date is left to the caller: None)."""
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def error_from_response(response: httpx.Response) -> APIError:
    """The exception for a non-2xx answer, from the server's native error body
    ({"detail", "param"?, "code"?}) or the OpenAI-shaped one ({"error": {...}})."""
    try:
        body = response.json()
    except ValueError:
        body = None
    param = code = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):  # the /v1 shape
        err = body["error"]
        detail, message, param, code = err, str(err.get("message", "")), err.get("param"), err.get("code")
    elif isinstance(body, dict):
        detail = body.get("detail")
        message, param, code = describe_detail(detail), body.get("param"), body.get("code")
    else:
        detail = message = response.text
    status = response.status_code
    cls = _BY_STATUS.get(status, InternalServerError if status >= 500 else APIError)
    return cls(message or response.reason_phrase or f"HTTP {status}", status=status, param=param, code=code,
               detail=detail, retry_after=retry_after_seconds(response.headers.get("Retry-After")),
               headers=dict(response.headers))
