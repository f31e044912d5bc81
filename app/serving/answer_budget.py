"""Large answers (attention maps) without unbounded memory or a blocked event loop.

An answer claims its estimated size from an `AnswerBudget` before it is computed and gives
it back only once its last byte has gone to the client (or the client has gone). So the
bytes of such answers held in memory, finished but not yet read by slow clients, never
exceed ATTNLENS_MAX_ANSWER_BYTES: a request that finds the budget spent waits up to
ATTNLENS_ANSWER_WAIT_S for room, then gets a 429 with Retry-After.

The answer is encoded (orjson) on a worker thread and sent in chunks; a client that takes
less than 1 MB (one chunk) in ATTNLENS_SEND_TIMEOUT_S is dropped, so a reader that never
reads cannot hold its claim forever.

`answer_with_claim` is the one sequence every analysis route's serving object runs: claim, call
the model (a client that goes away cancels it: `unless_disconnected`), release on failure, build
and encode the answer (holding the claim until it is sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import Any, Awaitable, Callable, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import numpy as np
import orjson
from fastapi import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from attnlens.app.server.api_errors import ApiError

log = logging.getLogger("attnlens.answers")

T = TypeVar("T")
CHUNK_BYTES = 1 << 20  # sent per write; gzip compresses chunks this size on a worker thread
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first": logged and counted, never sent


async def disconnected(request: Request) -> None:
    """Returns once the client has gone (the request's body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work` (a model call); a client that goes away first cancels it (the call stops at its
    next report point, app/engine/core.py's SteppedCall) and the handler ends with a 499 that is never sent."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():  # the client went first
        raise ApiError(CLIENT_CLOSED_REQUEST, "the client closed the request", code="client_closed")
    return task.result()


class AnswerBudget:
    """A counting semaphore of bytes, fair (first come, first served)."""

    def __init__(self, limit: int, wait_s: float):
        self.limit = limit
        self.wait_s = wait_s
        self.in_use: float = 0  # bytes: answer_bytes' estimates are floats
        self._cond = asyncio.Condition()
        self._freed_at: list[float] = []  # recent release times, for Retry-After

    async def claim(self, n: float, *, what: str,
                    instead: str = "ask for fewer layers or heads, a shorter text, or format f16/u8 with packing tril",
                    ) -> "Claim":
        """Hold n bytes until the claim is released; over the whole budget a 400 that says what to ask
        `instead`."""
        if n > self.limit:
            raise ApiError(400, f"{what} would be about {n / 1e6:.1f} MB, more than the whole budget for answers "
                                f"in flight ({self.limit / 1e6:.1f} MB, ATTNLENS_MAX_ANSWER_BYTES): {instead}",
                           code="answer_too_large")
        async with self._cond:
            try:
                await asyncio.wait_for(self._cond.wait_for(lambda: self.in_use + n <= self.limit), self.wait_s)
            except asyncio.TimeoutError:
                raise ApiError(429, f"server busy: {self.in_use / 1e6:.1f} MB of answers are still being sent "
                                    f"(limit {self.limit / 1e6:.1f} MB); retry later", code="answers_in_flight",
                               headers={"Retry-After": str(self.retry_after())}) from None
            self.in_use += n
        return Claim(self, n)

    def retry_after(self) -> int:
        """Seconds until room is likely: the mean gap between recent releases, at least 1."""
        now = time.monotonic()
        recent = [t for t in self._freed_at if now - t < 60]
        if len(recent) < 2:
            return max(1, math.ceil(self.wait_s))
        return max(1, math.ceil((recent[-1] - recent[0]) / (len(recent) - 1)))

    async def _release(self, n: float) -> None:
        async with self._cond:
            self.in_use -= n
            self._freed_at = self._freed_at[-15:] + [time.monotonic()]
            self._cond.notify_all()


class Claim:
    """Bytes held in an AnswerBudget until release() (idempotent)."""

    def __init__(self, budget: AnswerBudget, n: float):
        self.budget, self.n, self.released = budget, n, False

    async def release(self) -> None:
        if not self.released:
            self.released = True
            await self.budget._release(self.n)


_encoders: anyio.lowlevel.RunVar[anyio.CapacityLimiter] = anyio.lowlevel.RunVar("attnlens_encoders")


async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
    """Run fn(*args) on a worker thread, one such job at a time: building and encoding answers
    holds the GIL in stretches, and a dozen threads doing it at once would starve the event
    loop of it (every GIL hand-over then waits its turn behind them all)."""
    try:
        limiter = _encoders.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(1)
        _encoders.set(limiter)
    return await anyio.to_thread.run_sync(fn, *args, limiter=limiter)


def encode_json(content: Any) -> bytes:
    """JSON bytes of `content`; numpy arrays are written directly (no Python floats in between).

    orjson holds the GIL while it runs, so large arrays (and nested lists of them) are written
    one matrix at a time: the event loop's thread gets the GIL back between pieces."""
    if isinstance(content, np.ndarray) and content.ndim > 2:
        return b"[" + b",".join(encode_json(part) for part in content) + b"]"
    if isinstance(content, dict):
        return b"{" + b",".join(orjson.dumps(str(k)) + b":" + encode_json(v) for k, v in content.items()) + b"}"
    if isinstance(content, list) and content and isinstance(content[0], list) and content[0] \
            and isinstance(content[0][0], (list, np.ndarray)):
        return b"[" + b",".join(encode_json(part) for part in content) + b"]"
    return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


class ClaimedJSONResponse(Response):
    """Pre-encoded JSON sent in chunks, releasing its claim when done or abandoned."""

    media_type = "application/json"

    def __init__(self, body: bytes, claim: Claim, send_timeout_s: float, **kwargs):
        super().__init__(content=None, **kwargs)
        self.body_bytes = body
        self.claim = claim
        self.send_timeout_s = send_timeout_s
        self.headers["content-length"] = str(len(body))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            view = memoryview(self.body_bytes)
            for start in range(0, len(view), CHUNK_BYTES) or [0]:
                chunk = bytes(view[start:start + CHUNK_BYTES])
                more = start + CHUNK_BYTES < len(view)
                try:
                    await asyncio.wait_for(send({"type": "http.response.body", "body": chunk, "more_body": more}),
                                           self.send_timeout_s)
                except asyncio.TimeoutError:
                    # leaving the answer unfinished makes the server close the connection
                    log.warning("dropped a client that took less than 1 MB in %.0f s (%s)", self.send_timeout_s,
                                scope.get("path"))
                    return
        finally:
            self.body_bytes = b""
            await self.claim.release()


async def claimed_json(build: Callable[..., Any], args: tuple, claim: Claim,
                       send_timeout_s: float) -> ClaimedJSONResponse:
    """Build the content (`build(*args)`) and encode it, each on a worker thread (which calls `build`
    itself: the serving's code is never called back from here), into a response that holds
    `claim` until it is sent."""
    try:
        body = await off_loop(encode_json, await off_loop(build, *args))
    except BaseException:
        await claim.release()
        raise
    return ClaimedJSONResponse(body, claim, send_timeout_s)


async def _in_turn(served, calls: tuple) -> tuple:
    return tuple([await served.runner.call(call) for call in calls])


async def answer_with_claim(state, served, call, build: Callable[[Any], Any], *, need: float, what: str,
                            instead: str | None = None, request=None, check: Callable[[Any], None] | None = None,
                            hold: bool = True) -> Response:
    """One model call whose memory is claimed from the answer budget: claim `need` bytes (a 400 over
    the whole budget, saying what to ask `instead`; a 429 when it stays spent), run the model
    operation `call` (a tuple of operations: each in turn, the result a tuple) on `served`'s model side (with `request`, a client that goes away cancels it),
    `check` its result (an ApiError for a result the request cannot have), then `build` the answer's
    content from it on a worker thread.

    With `hold` the claim is held until the answer's last byte is sent (a ClaimedJSONResponse of
    build's content); without, the claim covers the model side's work only (maps scored there):
    it goes back once the call returns and build gives the answer's JSON bytes. On any failure the
    claim goes back at once."""
    claim = await state.answers.claim(need, what=what, **({"instead": instead} if instead is not None else {}))
    try:
        work = served.runner.call(call) if not isinstance(call, tuple) else _in_turn(served, call)
        result = await (unless_disconnected(request, work) if request is not None else work)
        if check is not None:
            check(result)
    except BaseException:
        await claim.release()
        raise
    if not hold:
        await claim.release()
        return Response(await off_loop(build, result), media_type="application/json")
    return await claimed_json(build, (result,), claim, state.settings.send_timeout_s)
