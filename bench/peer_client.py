"""A small asyncio HTTP client for bench_peers.py and token_path.py: whole requests to attnlens'
`POST /generate` and llama-server's `POST /completion`, streamed or not, many at once on one
event loop (a client that costs the machine little beside the two servers it measures).

Each request gives its send time, the arrival time of every token event (streamed), the time
its answer ended, and the tokens the server says it generated (attnlens: `usage.completion_tokens`;
llama.cpp: `tokens_predicted`), so that tokens / wall is counted from the answer, not guessed.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field


@dataclass
class Answer:
    t_send: float
    t_end: float = 0.0
    arrivals: list[float] = field(default_factory=list)  # token events (streamed only)
    tokens: int = 0  # as the server counts them
    error: str | None = None

    @property
    def wall(self) -> float:
        return self.t_end - self.t_send

    @property
    def first_token_s(self) -> float | None:
        return self.arrivals[0] - self.t_send if self.arrivals else None


def _dechunk(body: bytes) -> bytes:
    """A chunked transfer-encoded body -> its bytes."""
    out, i = bytearray(), 0
    while True:
        j = body.index(b"\r\n", i)
        size = int(body[i:j].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += body[j + 2:j + 2 + size]
        i = j + 2 + size + 2


def _request(path: str, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nConnection: close\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload


class _Events:
    """Server-sent events as they arrive: token events timed, the final event's count read."""

    def __init__(self, answer: Answer, llama: bool):
        self.answer, self.llama = answer, llama
        self.buf = b""
        self.in_done = False

    def feed(self, chunk: bytes, now: float) -> None:
        self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        for line in lines:
            self._line(line, now)

    def _line(self, line: bytes, now: float) -> None:
        a = self.answer
        if self.llama:  # data: {...}; the last one, "stop": true, carries the count
            if not line.startswith(b"data: "):
                return
            if b'"stop":true' in line:
                a.tokens = json.loads(line[6:])["tokens_predicted"]
            else:
                a.arrivals.append(now)
            return
        if line.startswith(b"event: token"):
            a.arrivals.append(now)
        elif line.startswith(b"event: done"):
            self.in_done = True
        elif line.startswith(b"event: error"):
            a.error = "error event"
        elif self.in_done and line.startswith(b"data: "):
            a.tokens = json.loads(line[6:])["usage"]["completion_tokens"]
            self.in_done = False


async def request(port: int, path: str, body: dict) -> Answer:
    """One whole request (streamed when body["stream"]), read to its end."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answer = Answer(time.perf_counter())
    writer.write(_request(path, body))
    llama = path == "/completion"
    events = _Events(answer, llama) if body.get("stream") else None
    raw = bytearray()
    while chunk := await reader.read(65536):
        if events is not None:
            events.feed(chunk, time.perf_counter())
        else:
            raw += chunk
    answer.t_end = time.perf_counter()
    writer.close()
    if events is None:
        _read_whole(answer, bytes(raw), llama)
    elif not answer.tokens and answer.error is None:
        answer.error = "the stream ended without its final event"
    return answer


def _read_whole(answer: Answer, raw: bytes, llama: bool) -> None:
    head, _, body = raw.partition(b"\r\n\r\n")
    if b" 200 " not in head.split(b"\r\n", 1)[0]:
        answer.error = head.split(b"\r\n", 1)[0].decode(errors="replace") + " " + body[:300].decode(errors="replace")
        return
    if b"transfer-encoding: chunked" in head.lower():
        body = _dechunk(body)
    data = json.loads(body)
    answer.tokens = data["tokens_predicted"] if llama else data["usage"]["completion_tokens"]


def run_all(port: int, path: str, bodies: list[dict]) -> tuple[list[Answer], float]:
    """Every body sent at once; the answers and the wall time from the first send to the last end."""

    async def main() -> list[Answer]:
        return await asyncio.gather(*(request(port, path, b) for b in bodies))

    t0 = time.perf_counter()
    answers = asyncio.run(main())
    return answers, time.perf_counter() - t0
