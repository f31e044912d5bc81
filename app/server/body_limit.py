"""Guard the request body: refuse bodies over a size limit (413), by Content-Length and by
counting, and bodies that arrive too slowly (408)."""

from __future__ import annotations

import asyncio
import time

from starlette.exceptions import HTTPException


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"request body larger than {limit} bytes")


class BodyTooSlow(HTTPException):
    def __init__(self, timeout_s: float):
        super().__init__(408, f"the request body did not arrive within {timeout_s:g} s "
                              f"(ATTNLENS_BODY_TIMEOUT_S)", headers={"Connection": "close"})


class BodyLimitMiddleware:
    """Checks the declared Content-Length up front and the bytes actually received, and gives
    the whole body `timeout_s` seconds to arrive.

    A body that lies about (or omits) its length, or trickles in, raises BodyTooLarge /
    BodyTooSlow from receive(), which the app's HTTPException handler turns into a 413 / 408
    like any other. Once the body is complete, receive() is passed through untouched (a
    handler may wait on it for the client's disconnect for as long as it likes).
    """

    def __init__(self, app, max_bytes: int, error_response, timeout_s: float | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.error_response = error_response  # (scope, status, message) -> ASGI response
        self.timeout_s = timeout_s

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
        complete = False
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s

        async def limited_receive():
            nonlocal received, complete
            if complete or deadline is None:
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    raise BodyTooSlow(self.timeout_s) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
                complete = complete or not message.get("more_body", False)
            else:
                complete = True
            return message

        await self.app(scope, limited_receive, send)
