"""uvicorn's HTTP protocol with a deadline and a size limit for request headers.

uvicorn closes a keep-alive connection that stays idle after a response, but a connection
that never sends a request, or sends its headers a byte at a time, would be held for ever.
Here every connection must complete a request's headers within `header_timeout_s` of being
opened (or of the previous response): if part of a request arrived it gets a 408, and the
connection is closed either way. (Slow bodies are timed by the body limit: app/server/middleware.py.)

uvicorn's httptools parser also takes headers of any size (16 MB of them got an answer).
Here the request line and headers together may hold `max_header_bytes` (ATTNLENS_MAX_HEADER_BYTES,
nginx's 32 KB by default): past that the request gets a 431 and the connection is closed,
before the rest is read.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_BODY = b'{"detail":"request headers not received in time","code":"header_timeout"}'
TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: "
                    + str(len(_BODY)).encode() + b"\r\nconnection: close\r\n\r\n" + _BODY)


_LARGE = b'{"detail":"request headers larger than the limit (ATTNLENS_MAX_HEADER_BYTES)","code":"headers_too_large"}'
TOO_LARGE_RESPONSE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                      b"content-length: " + str(len(_LARGE)).encode() + b"\r\nconnection: close\r\n\r\n" + _LARGE)


class HeaderTimeoutProtocol(HttpToolsProtocol):
    header_timeout_s: float = 10.0
    max_header_bytes: int = 32_768

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        self._request_begun = False
        self._in_headers, self._header_bytes = True, 0
        super().connection_made(transport)
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._request_begun = False
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def data_received(self, data: bytes) -> None:
        """Count the bytes of a request's head: one still unfinished past the limit ends here (before
        the parser holds more of it); a finished one is measured exactly by on_url / on_header."""
        if self._in_headers:
            self._header_bytes += len(data)
        super().data_received(data)
        if self._in_headers and self._header_bytes > self.max_header_bytes:
            self._refuse_large_head()

    def on_message_begin(self) -> None:
        self._request_begun = True
        self._head_size = 0
        # the next request's head starts here, not at the previous response's end: the rest of a body
        # that was answered before it was read (a 413) may still arrive, and it is no head
        if not self._in_headers:
            self._in_headers, self._header_bytes = True, 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def _count_head(self, n: int) -> None:
        self._head_size = getattr(self, "_head_size", 0) + n
        if self._head_size > self.max_header_bytes:
            self._head_too_large = True
            raise ValueError("request headers too large")  # the parser stops; uvicorn calls send_400_response

    def send_400_response(self, msg: str) -> None:
        if getattr(self, "_head_too_large", False):
            self._refuse_large_head()
        else:
            super().send_400_response(msg)

    def _refuse_large_head(self) -> None:
        if not self.transport.is_closing():
            self._disarm_header_timer()
            self.transport.write(TOO_LARGE_RESPONSE)
            self.transport.close()

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self._request_begun:
            self.transport.write(TIMEOUT_RESPONSE)
        self.transport.close()

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        self._in_headers = False
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self.pipeline:
            self._arm_header_timer()  # the next request's headers get the same time

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)


def protocol_with_header_timeout(timeout_s: float, max_header_bytes: int = 32_768) -> type[HeaderTimeoutProtocol]:
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,),
                {"header_timeout_s": timeout_s, "max_header_bytes": max_header_bytes})
