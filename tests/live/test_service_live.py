"""One real `attnlens serve` process on a free localhost port, driven over TCP by httpx
and by the official `openai` client: streaming, determinism, concurrency, the queue limit,
client disconnects, and /healthz latency while generations run.

The server runs a tiny random model with a 2048-token context so that a long generation
holds its slot for seconds (4 x 2000 decode steps before the first slot frees), with
MAX_CONCURRENT=4 and MAX_QUEUE=12: 16 requests fit, the 17th is refused.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from helpers import REPO_ROOT, never_eos_checkpoint, run_async, sse_events
from live_server import free_port, live_server

pytestmark = pytest.mark.slow

CONCURRENT, QUEUE = 4, 12
CONTEXT, LONG = 2048, 2000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = never_eos_checkpoint(tmp_path_factory.mktemp("live") / "tiny2k", context_length=CONTEXT)
    env = {"ATTNLENS_MAX_CONCURRENT": str(CONCURRENT), "ATTNLENS_MAX_QUEUE": str(QUEUE),
           "ATTNLENS_MAX_NEW_TOKENS": str(LONG), "OMP_NUM_THREADS": "1", "ATTNLENS_LOG_LEVEL": "warning"}
    with live_server(ckpt, tmp_path_factory.mktemp("live-logs"), env=env) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=60)


def metric_or_zero(http, name: str) -> float:
    try:
        return metric(http, name)
    except AssertionError:
        return 0.0


def metric(http, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_every_endpoint_answers(http):
    assert http.get("/healthz").json() == {"status": "ok"}
    assert http.get("/readyz").status_code == 200
    info = http.get("/model").json()
    assert info["context_length"] == CONTEXT and info["device"] == "cpu"
    assert http.get("/v1/models").json()["data"][0]["id"] == "tiny2k"
    assert http.get("/").status_code in (200, 404)
    assert http.get("/openapi.json").json()["info"]["title"] == "attnlens"
    d = http.post("/attention", json={"text": "To be, or not", "format": "u8"}).json()
    assert d["shape"][:2] == [2, 4]
    d = http.post("/generate", json={"prompt": "To be", "max_new_tokens": 4, "temperature": 0}).json()
    assert d["usage"]["prompt_tokens"] == 2
    assert "attnlens_http_requests_total" in http.get("/metrics").text


def test_stream_over_tcp_matches_plain_and_is_deterministic(http):
    body = {"prompt": "Whether 'tis nobler", "max_new_tokens": 24, "temperature": 1.0, "seed": 42, "logprobs": 1}
    a = http.post("/generate", json=body).json()
    assert http.post("/generate", json=body).json()["text"] == a["text"]
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r.iter_lines()))
    tokens = [json.loads(d) for e, d in events if e == "token"]
    assert events[-1][0] == "done"
    done = json.loads(events[-1][1])
    assert [t["id"] for t in tokens] == [t["id"] for t in a["tokens"]]
    assert "".join(t["delta"] for t in tokens) + done["delta"] == a["text"]
    assert done["prompt_tokens"] == a["prompt_tokens"] and len(done["prompt_tokens"]) == done["usage"]["prompt_tokens"]


def test_openai_client_plain_and_streamed(http, oai):
    native = http.post("/generate", json={"prompt": "To be", "max_new_tokens": 12, "temperature": 0}).json()
    c = oai.completions.create(model="tiny2k", prompt="To be", max_tokens=12, temperature=0, logprobs=2)
    assert c.object == "text_completion" and c.model == "tiny2k"
    choice = c.choices[0]
    assert choice.text == native["text"]
    assert choice.finish_reason == ("length" if native["finish_reason"] == "length" else "stop")
    assert choice.logprobs.tokens == [t["text"] for t in native["tokens"]]
    assert all(len(d) <= 2 for d in choice.logprobs.top_logprobs)
    assert c.usage.completion_tokens == native["usage"]["completion_tokens"]

    stream = oai.completions.create(model="tiny2k", prompt="To be", max_tokens=12, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(ch.choices[0].text for ch in chunks) == native["text"]
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason

    seeded = dict(model="tiny2k", prompt="No more", max_tokens=10, temperature=1.0, seed=7)
    assert oai.completions.create(**seeded).choices[0].text == oai.completions.create(**seeded).choices[0].text


def test_openai_client_errors(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="tiny2k", prompt="To be, or not to be, that is the question. " * 6,
                               max_tokens=LONG)
    assert e.value.status_code == 400
    err = e.value.response.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert f"max_tokens ({LONG})" in err["message"] and f"context length of {CONTEXT}" in err["message"]
    with pytest.raises(openai.UnprocessableEntityError) as e:
        oai.completions.create(model="tiny2k", prompt="To be", temperature=5)
    err = e.value.response.json()["error"]
    assert err["param"] == "temperature" and err["type"] == "invalid_request_error"


def test_413_over_tcp(http):
    big = b'{"prompt": "' + b"a" * 1_100_000 + b'"}'
    r = http.post("/generate", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413
    r = http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "error" in r.json()


def test_the_rest_of_a_refused_body_is_not_counted_as_the_next_requests_headers(server):
    """A body over the limit is answered (413) before it is read; the rest of it still arrives after
    that answer, and must not count against the header limit (ATTNLENS_MAX_HEADER_BYTES): the next
    request on the same connection gets its own answer, not a 431."""
    host, port = server.base_url.removeprefix("http://").split(":")
    body = b'{"prompt": "' + b"a" * 1_100_000 + b'"}'
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = b""
        while reply.count(b"HTTP/1.1 ") < 2:
            chunk = sock.recv(65536)
            if not chunk:  # the server may close after the 413: then no second answer at all
                break
            reply += chunk
    text = reply.decode("latin-1")
    assert text.startswith("HTTP/1.1 413"), text[:200]
    assert "431" not in text, text


def test_declared_oversized_body_is_refused_before_it_is_sent(server):
    """Content-Length over the limit: 413 at once, without waiting for the body."""
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 5000000\r\n\r\n{")
        reply = b""  # recv times out (the test fails) if the server waits for the 5 MB
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
    text = reply.decode("latin-1")
    assert text.startswith("HTTP/1.1 413"), text
    assert "5000000" in text


PROMPTS = ["To be", "Or not", "The slings", "Whether 'tis", "And by", "No more", "To die", "Café"]


def _request(i: int) -> dict:
    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_new_tokens": 16 + i % 5}
    body.update({"temperature": 0} if i % 3 == 0 else {"temperature": 1.0, "seed": 1000 + i, "top_k": 40})
    return body


def test_16_concurrent_requests_each_match_running_alone(http, server):
    alone = [http.post("/generate", json=_request(i)).json() for i in range(16)]

    async def together():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as c:
            async def one(i):
                if i % 4 == 3:  # some streamed
                    async with c.stream("POST", "/generate", json={**_request(i), "stream": True}) as r:
                        lines = [line async for line in r.aiter_lines()]
                    events = list(sse_events(lines))
                    return [json.loads(d)["id"] for e, d in events if e == "token"], events[-1][0]
                r = await c.post("/generate", json=_request(i))
                assert r.status_code == 200, r.text
                return [t["id"] for t in r.json()["tokens"]], "done"

            return await asyncio.gather(*(one(i) for i in range(16)))

    results = run_async(together())
    for i, (ids, last) in enumerate(results):
        assert last == "done"
        assert ids == [t["id"] for t in alone[i]["tokens"]], f"request {i} differs when run concurrently"


def test_queue_full_429_disconnect_frees_slots_and_healthz_stays_fast(http, server, oai):
    long_body = {"prompt": "To be", "max_new_tokens": LONG, "temperature": 0.8, "stream": True}
    saturated = (CONCURRENT, QUEUE)

    async def scenario():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as c:
            streams = []
            for _ in range(CONCURRENT + QUEUE):
                req = c.build_request("POST", "/generate", json=long_body)
                streams.append(await c.send(req, stream=True))
            assert all(r.status_code == 200 for r in streams)
            # every slot is busy and the queue is full
            deadline = time.monotonic() + 20
            while load() != saturated:
                assert time.monotonic() < deadline, "requests were not admitted"
                await asyncio.sleep(0.05)

            r = await c.post("/generate", json={"prompt": "To be", "max_new_tokens": 2})
            assert r.status_code == 429, (r.text, load())
            assert int(r.headers["retry-after"]) >= 1
            assert "busy" in r.json()["detail"]
            r = await c.post("/v1/completions", json={"prompt": "To be", "max_tokens": 2})
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
            assert "retry-after" in r.headers
            with pytest.raises(openai.RateLimitError):
                await asyncio.to_thread(oai.completions.create, model="tiny2k", prompt="To be", max_tokens=2)
            assert load() == saturated  # (else this machine outran the test: nothing was checked)

            # liveness answers fast while four generations run
            latencies = []
            for _ in range(10):
                t0 = time.perf_counter()
                assert (await c.get("/healthz")).status_code == 200
                latencies.append(time.perf_counter() - t0)
                await asyncio.sleep(0.02)
            assert max(latencies) < 0.1, latencies

            # the running streams do deliver tokens
            first = await streams[0].aiter_lines().__anext__()
            assert first == "event: token"

            # now every client hangs up: generation must stop and the slots come free
            cancelled_before = metric(http, 'attnlens_engine_cancelled_requests{model="tiny2k"}')
            finished_before = finished()
            for r in streams:
                await r.aclose()
            t0 = time.monotonic()
            while load() != (0, 0):
                # 16 x 2000 tokens would take far longer than this if they ran on
                assert time.monotonic() - t0 < 5, "cancelled generations kept their slots"
                await asyncio.sleep(0.05)
            # all stopped early: none ran to its 2000 tokens
            cancelled = metric(http, 'attnlens_engine_cancelled_requests{model="tiny2k"}')
            assert cancelled - cancelled_before == CONCURRENT + QUEUE
            assert finished() == finished_before

            t0 = time.monotonic()
            r = await c.post("/generate", json={"prompt": "To be", "max_new_tokens": 4, "temperature": 0})
            assert r.status_code == 200 and time.monotonic() - t0 < 5

    def finished() -> dict[str, float]:
        out = {}
        for line in http.get("/metrics").text.splitlines():
            if line.startswith("attnlens_generations_total{"):
                reason = line.split('finish_reason="')[1].split('"')[0]
                if reason not in ("cancelled", "error"):  # those did not run to an end
                    out[reason] = float(line.split()[-1])
        return out

    def load():
        return (metric(http, 'attnlens_requests_in_flight{model="tiny2k"}'),
                metric(http, 'attnlens_queue_depth{model="tiny2k"}'))

    run_async(scenario())
    assert "Traceback" not in server.log(), server.log()


def test_non_streaming_request_is_cancelled_when_its_client_leaves(http, server):
    """An abandoned plain (non-streamed) generation stops too. Three long streams share the
    engine with it, so it would need 4 x 2000 decode steps to finish on its own."""
    long_stream = {"prompt": "To be", "max_new_tokens": LONG, "stream": True}

    async def scenario():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as c:
            streams = [await c.send(c.build_request("POST", "/generate", json=long_stream), stream=True)
                       for _ in range(CONCURRENT - 1)]
            try:
                before = metric(http, 'attnlens_engine_cancelled_requests{model="tiny2k"}')
                closed_before = metric_or_zero(
                    http, 'attnlens_http_requests_total{method="POST",model="tiny2k",route="/generate",status="499"}')
                with pytest.raises(httpx.ReadTimeout):  # gives up waiting and closes the connection
                    await c.post("/generate", json={"prompt": "Or not", "max_new_tokens": LONG},
                                 timeout=httpx.Timeout(60, read=0.5))
                deadline = time.monotonic() + 5
                while metric(http, 'attnlens_engine_cancelled_requests{model="tiny2k"}') != before + 1:
                    assert time.monotonic() < deadline, "the abandoned generation was not cancelled"
                    await asyncio.sleep(0.05)
                assert metric(http, 'attnlens_requests_in_flight{model="tiny2k"}') == CONCURRENT - 1  # the streams go on
                # the handler ended too, and the request is counted (499: the client closed it)
                counted = 'attnlens_http_requests_total{method="POST",model="tiny2k",route="/generate",status="499"}'
                deadline = time.monotonic() + 5
                while metric(http, counted) != closed_before + 1:
                    assert time.monotonic() < deadline, "the abandoned request's handler did not end"
                    await asyncio.sleep(0.05)
            finally:
                for r in streams:
                    await r.aclose()

    run_async(scenario())
    deadline = time.monotonic() + 5
    while metric(http, 'attnlens_requests_in_flight{model="tiny2k"}') != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_unloadable_model_exits_non_zero_with_a_clear_message(tmp_path):
    bad = tmp_path / "no-model-here"
    proc = subprocess.run(
        [sys.executable, "-m", "attnlens.app.cli", "serve", "--model", str(bad), "--port", str(free_port())],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "ATTNLENS_DEVICE": "cpu", "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert f"cannot load the model from {bad}" in out and "does not exist" in out
