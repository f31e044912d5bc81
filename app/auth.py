"""Optional API key: with ATTNLENS_API_KEY set, every request must carry
`Authorization: Bearer <key>` (as OpenAI clients, vLLM and TGI do), except liveness and
readiness probes and the web page's own files (/, /static/...), which hold no data.
Without the setting nothing is checked."""

from __future__ import annotations

import hmac

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/", "/favicon.ico"})
OPEN_PREFIXES = ("/static/",)


def is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str, error_response):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.error_response = error_response  # (scope, status, message, headers) -> ASGI response

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or is_open(scope.get("path", "")):
            return await self.app(scope, receive, send)
        sent = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                sent = value
                break
        if hmac.compare_digest(sent, self.expected):
            return await self.app(scope, receive, send)
        reason = "no API key was sent" if not sent else "the API key is not valid"
        response = self.error_response(scope, 401, f"{reason}: send the header `Authorization: Bearer "
                                                   f"<ATTNLENS_API_KEY>`", {"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
