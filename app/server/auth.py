"""Optional API key: with ATTNLENS_API_KEY set, every request must carry
`Authorization: Bearer <key>` (as OpenAI clients, vLLM and TGI do), except liveness and
readiness probes and the web page's own files (/, /static/..., the API docs' assets), which
hold no data. The scheme is case-insensitive (`bearer <key>` works, as RFC 7235 says); the key
is compared in constant time. Without the setting nothing is checked."""

from __future__ import annotations

import hmac

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/", "/favicon.ico"})
OPEN_PREFIXES = ("/static/", "/docs-assets/")


def is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


def bearer_token(header: bytes) -> bytes | None:
    """The credentials of an `Authorization: Bearer <token>` header (any case of "Bearer"), else None."""
    scheme, _, token = header.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.strip(b" \t")


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str, error_response):
        self.app = app
        self.expected = api_key.encode()
        self.error_response = error_response  # (scope, status, message, headers) -> ASGI response

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or is_open(scope.get("path", "")):
            return await self.app(scope, receive, send)
        sent = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                sent = value
                break
        token = bearer_token(sent)
        if token is not None and hmac.compare_digest(token, self.expected):
            return await self.app(scope, receive, send)
        reason = "no API key was sent" if not sent else "the API key is not valid"
        response = self.error_response(scope, 401, f"{reason}: send the header `Authorization: Bearer "
                                                   f"<ATTNLENS_API_KEY>`", {"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


UNAUTHORIZED = {"description": "no API key, or a wrong one (with ATTNLENS_API_KEY set): send `Authorization: "
                               "Bearer <key>`", "content": {"application/json": {"schema": {
                                   "$ref": "#/components/schemas/ErrorBody"}}}}


def document_bearer(app) -> None:
    """With an API key set, the OpenAPI description says which operations need it (so /docs'
    Authorize button and generated clients send it) and that they answer 401 without it."""
    default = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = default()
            components = schema.setdefault("components", {})
            components.setdefault("securitySchemes", {})["bearer"] = {
                "type": "http", "scheme": "bearer", "description": "ATTNLENS_API_KEY"}
            from attnlens.app.api.ops_schemas import ErrorBody

            components.setdefault("schemas", {}).setdefault(
                "ErrorBody", ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}"))
            for path, operations in schema.get("paths", {}).items():
                if not is_open(path):
                    for operation in operations.values():
                        operation["security"] = [{"bearer": []}]
                        operation.setdefault("responses", {}).setdefault("401", UNAUTHORIZED)
        return app.openapi_schema

    app.openapi = openapi
