"""The inference engine: the one owner of the model.

Requests are admitted on the event loop (at most `max_concurrent` in flight plus
`max_queue` waiting, else QueueFull) and handed to one worker thread. Each iteration the
worker admits waiting requests into free slots, then advances every active request by
one step (the prefill, or one decode step). So concurrent generations progress together,
and a later version can stack the active requests' decode steps into one batched forward
at the single place marked BATCHING below.

Every request keeps its own state (KV cache, random generator, produced tokens, text
stream) in its own object: no request can see another's tokens. Results go back to the
event loop through a per-request asyncio.Queue fed with loop.call_soon_threadsafe. A
request's cancelled flag is checked before each of its steps, so a client that goes away
stops its generation within one step and frees its slot. An exception in one request's
step is reported to that request only; the worker thread carries on.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import torch

from model import Checkpoint, SamplingParams
from model.generate import RowSampler, decode_step, make_generator

from .textstream import TextStream

log = logging.getLogger("attnlens.engine")


class QueueFull(Exception):
    """No slot and no room in the waiting queue."""

    def __init__(self, limit: int, retry_after: int):
        super().__init__(f"server busy: {limit} requests already in flight or waiting; retry later")
        self.retry_after = retry_after


class EngineClosed(Exception):
    """The engine is shutting down."""


@dataclass
class GenerationJob:
    """What to generate; validated by the caller (lengths fit the context)."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    n_logprobs: int = 0
    return_attention: bool = False
    prompt_logprobs: int | None = None  # also score the prompt tokens (OpenAI echo)


@dataclass
class Event:
    kind: str  # "token" | "done" | "error"
    data: dict[str, Any]


_ids = itertools.count(1)


class _Work:
    """One admitted unit of work; the worker calls step() until it returns True."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.id = next(_ids)
        self.loop = loop
        self.cancelled = False
        self.t_submit = time.perf_counter()
        self.t_start: float | None = None
        self._final: Callable[[], None] | None = None  # sent once the slot is free again

    def cancel(self) -> None:
        self.cancelled = True

    def deliver_final(self) -> None:
        """Called by the worker after retiring the work, so that a client that has seen the
        end of its request also sees its slot free (in_flight already decremented)."""
        final, self._final = self._final, None
        if final is not None:
            final()

    def step(self, engine: "Engine") -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def fail(self, message: str) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class GenerationRequest(_Work):
    def __init__(self, loop, job: GenerationJob, tokenizer):
        super().__init__(loop)
        self.job = job
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.tokenizer = tokenizer
        self.text = TextStream(tokenizer, job.stop)
        self.cache = None
        self.generator: torch.Generator | None = None
        self.last_token: int | None = None
        self.produced = 0
        self.t_first: float | None = None
        self.finished = False
        self.prompt_scores: list[dict] | None = None

    # --- event loop side ---------------------------------------------------
    async def events(self) -> AsyncIterator[Event]:
        """Token events, then exactly one done or error event."""
        while True:
            event = await self.queue.get()
            yield event
            if event.kind != "token":
                return

    # --- worker side -------------------------------------------------------
    def _emit(self, kind: str, data: dict) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, Event(kind, data))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def fail(self, message: str) -> None:
        if not self.finished:
            self.finished = True
            self._final = lambda: self._emit("error", {"message": message})

    def step(self, engine: "Engine") -> bool:
        model, job, tok = engine.model, self.job, self.tokenizer
        device = engine.device
        if self.cache is None:  # prefill
            self.t_start = time.perf_counter()
            self.cache = model.new_kv_cache(1)
            self.generator = make_generator(job.sampling.seed, device)
            inputs = torch.tensor([job.prompt_ids], dtype=torch.long, device=device)
            last_only = job.prompt_logprobs is None
        else:
            inputs = torch.tensor([[self.last_token]], dtype=torch.long, device=device)
            last_only = True
        # BATCHING: this forward is the per-request decode step a batched engine would stack.
        sampler = RowSampler(job.sampling, self.generator, job.n_logprobs, job.return_attention)
        step = decode_step(model, self.cache, inputs, [sampler], last_only=last_only)
        logits, generated = step.output.logits, step.tokens[0]
        if self.produced == 0 and job.prompt_logprobs is not None:
            self._score_prompt(logits[0].float(), job.prompt_logprobs)
        if job.max_new_tokens == 0:
            return self._finish("length")
        token = generated.id
        self.produced += 1
        if self.t_first is None:
            self.t_first = time.perf_counter()
        if token == tok.eos_id:
            return self._finish("eos")
        extra = {"logprob": generated.logprob, "top": None, "attention": None}
        if job.n_logprobs > 0:
            extra["top"] = list(zip(generated.top_ids, generated.top_logprobs))
        if generated.attention is not None:
            extra["attention"] = [[[round(x, 6) for x in head] for head in a.tolist()] for a in generated.attention]
        for r in self.text.push(self.produced - 1, token, extra):
            self._emit("token", self._token_payload(r))
        if self.text.stopped:
            return self._finish("stop")
        if self.produced >= job.max_new_tokens or int(self.cache.lengths[0]) >= self.cache.capacity:
            return self._finish("length")
        self.last_token = token
        return False

    def _score_prompt(self, logits: torch.Tensor, k: int) -> None:
        """Log-probabilities of each prompt token given the ones before it."""
        tok, ids = self.tokenizer, self.job.prompt_ids
        lp = torch.log_softmax(logits, dim=-1)  # (T, V): row i predicts token i + 1
        items = [{"id": ids[0], "text": tok.display_text(ids[0]), "logprob": None, "top_logprobs": None}]
        for i in range(1, len(ids)):
            row = lp[i - 1]
            top = None
            if k > 0:
                t = torch.topk(row, min(k, row.shape[-1]))
                top = [self._alt(j, v) for j, v in zip(t.indices.tolist(), t.values.tolist())]
            items.append({"id": ids[i], "text": tok.display_text(ids[i]),
                          "logprob": float(row[ids[i]]), "top_logprobs": top})
        self.prompt_scores = items

    def _alt(self, token_id: int, logprob: float) -> dict:
        return {"id": token_id, "text": self.tokenizer.display_text(token_id), "logprob": logprob}

    def _token_payload(self, r) -> dict:
        extra = r.extra
        payload = {"index": r.index, "id": r.id, "text": r.text, "delta": r.delta, "logprob": extra["logprob"]}
        payload["top_logprobs"] = [self._alt(i, v) for i, v in extra["top"]] if extra["top"] is not None else None
        if extra["attention"] is not None:
            payload["attention"] = extra["attention"]
        return payload

    def _finish(self, reason: str) -> bool:
        if reason != "stop":
            for r in self.text.finish():
                self._emit("token", self._token_payload(r))
        now = time.perf_counter()
        t_start = self.t_start or now
        t_first = self.t_first or now
        gen_s = max(now - t_start, 1e-9)
        n_prompt = len(self.job.prompt_ids)
        data = {
            "finish_reason": reason,
            "text": self.text.text,
            "delta": self.text.unsent,  # text no token event carried (a dangling partial character)
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": self.produced,
                      "total_tokens": n_prompt + self.produced},
            "timings": {
                "queue_ms": round((t_start - self.t_submit) * 1000, 3),
                "prefill_ms": round((t_first - t_start) * 1000, 3),
                "decode_ms": round((now - t_first) * 1000, 3),
                "tokens_per_second": round(self.produced / gen_s, 3),
                "time_to_first_token_ms": round((t_first - self.t_submit) * 1000, 3),
            },
        }
        if self.prompt_scores is not None:
            data["prompt_logprobs"] = self.prompt_scores
        self.finished = True
        self._final = lambda: self._emit("done", data)
        return True


class CallRequest(_Work):
    """Run fn(model) once on the worker thread (e.g. one attention forward)."""

    def __init__(self, loop, fn: Callable[[Any], Any]):
        super().__init__(loop)
        self.fn = fn
        self.future: asyncio.Future = loop.create_future()

    def _set(self, setter, value) -> None:
        def apply():
            if not self.future.done():
                setter(value)

        try:
            self.loop.call_soon_threadsafe(apply)
        except RuntimeError:
            pass

    def step(self, engine: "Engine") -> bool:
        self.t_start = time.perf_counter()
        result = self.fn(engine.model)
        self._final = lambda: self._set(self.future.set_result, result)
        return True

    def fail(self, message: str) -> None:
        self._final = lambda: self._set(self.future.set_exception, RuntimeError(message))


class Engine:
    def __init__(self, checkpoint: Checkpoint, *, max_concurrent: int = 8, max_queue: int = 32):
        self.checkpoint = checkpoint
        self.model = checkpoint.model
        self.tokenizer = checkpoint.tokenizer
        self.config = checkpoint.config
        self.device = self.model.tok_emb.weight.device
        self.dtype = self.model.tok_emb.weight.dtype
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._waiting: collections.deque[_Work] = collections.deque()
        self._active: list[_Work] = []
        self._admitted = 0  # waiting + active, counted at submission
        self._closed = False
        self._avg_seconds = 1.0  # moving average of a request's time in the engine
        self.errors = 0  # steps that raised
        self.cancelled = 0  # requests dropped because their client went away
        self._thread = threading.Thread(target=self._run, name="attnlens-engine", daemon=True)
        self._thread.start()

    # --- introspection (metrics) -------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self._active)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # --- event loop side ---------------------------------------------------
    def _admit(self, work: _Work) -> None:
        with self._lock:
            if self._closed:
                raise EngineClosed("the server is shutting down")
            limit = self.max_concurrent + self.max_queue
            if self._admitted >= limit:
                # a slot frees roughly every avg / max_concurrent seconds; ask for a few
                wait = self._avg_seconds * (1 + len(self._waiting)) / self.max_concurrent
                raise QueueFull(limit, max(1, math.ceil(wait)))
            self._admitted += 1
            self._waiting.append(work)
            self._wakeup.notify()

    def submit(self, job: GenerationJob) -> GenerationRequest:
        """Admit a generation (raises QueueFull / EngineClosed); read it with .events()."""
        req = GenerationRequest(asyncio.get_running_loop(), job, self.tokenizer)
        self._admit(req)
        return req

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(model) on the worker thread, in turn with the generations."""
        req = CallRequest(asyncio.get_running_loop(), fn)
        self._admit(req)
        try:
            return await req.future
        finally:
            req.cancel()

    def close(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._closed = True
            self._wakeup.notify()
        self._thread.join(timeout)

    # --- worker thread -----------------------------------------------------
    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._lock:
                    while not self._closed and not self._waiting and not self._active:
                        self._wakeup.wait()
                    if self._closed:
                        pending = list(self._waiting) + self._active
                        self._waiting.clear()
                        self._active.clear()
                        break
                    # cancelled requests still waiting free their place right away
                    for work in [w for w in self._waiting if w.cancelled]:
                        self._waiting.remove(work)
                        self._admitted -= 1
                        self.cancelled += 1
                    while self._waiting and len(self._active) < self.max_concurrent:
                        self._active.append(self._waiting.popleft())
                    active = list(self._active)
                for work in active:
                    done = True
                    if work.cancelled:
                        self.cancelled += 1
                    else:
                        try:
                            done = work.step(self)
                        except Exception as e:  # one request's failure is its own
                            self.errors += 1
                            log.exception("request %s failed", work.id)
                            work.fail(f"internal error while generating: {type(e).__name__}: {e}")
                    if done:
                        self._retire(work)
        for work in pending:
            work.fail("the server is shutting down")
            work.deliver_final()

    def _retire(self, work: _Work) -> None:
        if isinstance(work, GenerationRequest):
            work.cache = None  # free the KV cache now, not when the handle is collected
        with self._lock:
            self._active.remove(work)
            self._admitted -= 1
            spent = time.perf_counter() - work.t_submit
            self._avg_seconds = 0.8 * self._avg_seconds + 0.2 * spent
        work.deliver_final()
