"""Refuse request bodies over a size limit with 413: by Content-Length, and by counting."""

from __future__ import annotations

from starlette.exceptions import HTTPException


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"request body larger than {limit} bytes")


class BodyLimitMiddleware:
    """Checks the declared Content-Length up front and the bytes actually received.

    A body that lies about (or omits) its length raises BodyTooLarge from receive(),
    which the app's HTTPException handler turns into a 413 like any other.
    """

    def __init__(self, app, max_bytes: int, error_response):
        self.app = app
        self.max_bytes = max_bytes
        self.error_response = error_response  # (scope, status, message) -> ASGI response

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    response = self.error_response(scope, 413, f"request body of {declared} bytes is larger "
                                                                f"than the limit of {self.max_bytes} bytes")
                    return await response(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)
