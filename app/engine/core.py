"""The engine core: the one owner of the model. It holds the generations that have a slot, the
batch, the KV cache's rows or blocks and the model calls, and runs them; it knows nothing of
requests' server-side state, event loops or HTTP. What it produces goes, as typed records
(records.py), to the output sink it was given: in this process the front's (client.py's
InprocClient), in an engine process a pipe to the server (worker.py). Either way the same
class runs, on whichever thread calls run().

Each `step()` (vLLM v1's EngineCore.step: schedule, execute, update):
  1. schedule  take the generations handed over since the last step; drop cancelled and stopped
               ones (their cache rows are freed and the rows kept contiguous);
  2. call      a slice of the model call that runs (an /attention analysis), from where it
               paused through its report points (SteppedCall, below) until `call_slice_s` has
               passed: a long call pauses after each piece of its work (model/hooks.py's
               row_pieces), so the generations get this step's prefill piece and decode step
               between its slices and their streams keep their tokens coming; a
               heartbeat (an empty hand-over, at most one a second) goes to the sink for the
               watchdog; a call whose caller went away stops at its next report point. The
               calls run one at a time, oldest first;
  3. prefill   the next piece of a long prompt (one over `prefill_chunk` tokens, prefilled a
               piece a step into the row after the decoding ones, one such prompt at a time;
               `prefill_chunk_alone` tokens a piece while nothing else decodes or waits);
               then the prompts of newly admitted generations into free cache rows: the
               oldest, plus more (right-padded, one forward) while they hold no more tokens
               than one full-context prompt, so the running streams wait one long prefill at most;
  4. decode    ONE batched forward over every decoding generation's row of the KV cache,
               each row at its own length (on CUDA a replayed CUDA graph of it), then sample
               every row with that generation's own parameters and seeded generator
               (model.decoding.decode_step);
  5. update    hand the step's records (tokens with log-probs and attention rows as tensors,
               prompt scores, finishes; a model call's result) to the sink in one call (on the
               CPU a prefill's first tokens in one of their own before the decode step, so they
               reach their clients a step sooner); on CUDA once the next step is launched, so
               that they are handed over while the device computes (vLLM's asynchronous output
               processing).

A forward that raises is retried row by row, so one request's exception stays its own. A
cancelled generation stops at the next step. Every generation handed to the core ends with
exactly one FinishRecord, emitted once its row is free; every model call with one CallResult.
Admission (who gets a slot, who waits) is the front's (front.py).
"""

from __future__ import annotations

import collections
import contextvars
import logging
import threading
import time
from typing import Callable, Generic, TypeVar

import greenlet
import torch

from attnlens.app.engine import heap
from attnlens.app.engine.records import (
    MODEL_CALL_FAILED,
    CallResult,
    CoreRecord,
    FinishRecord,
    PromptRecord,
    TokenRecord,
)
from attnlens.app.engine.request import CoreCall, Generation, GenerationParams
from attnlens.app.engine.scheduler import Scheduler
from attnlens.model import Checkpoint, family_of
from attnlens.model.analysis.operations import run_operation
from attnlens.model.cuda_graphs import GraphedDecoder
from attnlens.model.decoding import RowSampler, decode_step, make_generator
from attnlens.model.families.contract import FixedShapeDecoder
from attnlens.model.hooks import batch_hooks, hooked
from attnlens.model.kv_cache import BlockCache, KVCache, RowCache, cache_paged

__all__ = ["CallCancelled", "EngineCore", "Generation", "GenerationParams", "OutputSink", "SteppedCall"]

log = logging.getLogger("attnlens.engine")

# Where the core's records go: called on the core's thread, one call per hand-over (an empty
# list is a heartbeat: the core is working)
OutputSink = Callable[[list[CoreRecord]], None]


def _samplers(gens: list[Generation]) -> list[RowSampler]:
    """Their rows' samplers (the core makes each before its generation's first forward)."""
    samplers = [g.sampler for g in gens]
    assert None not in samplers, "a generation that the core did not start"
    return samplers  # type: ignore[return-value]


class CallCancelled(Exception):
    """The caller of a model call went away: the call stopped at its next report point."""


T = TypeVar("T")
Report = Callable[[], None]  # a report point: where a call may pause (or stop)


class SteppedCall(Generic[T]):
    """A model call that the core steps: `fn(report)` runs until the operation calls `report()`
    (after each block of its work: an /attention analysis of a long prompt), then control goes
    back to the core, which runs the generations' step and resumes it (vLLM's core loop, with a
    long operation as one more kind of work in it); once stop() was asked, report() raises
    CallCancelled. Its value or exception is kept when it ends.

    The operation is ordinary code (model/analysis/), whose report points lie deep inside forwards
    and hook points. It runs on a greenlet of its own: a stack that it leaves at each report point
    and that the core re-enters at the next step, on the core's own thread. So the core's loop
    stays flat, nothing calls step() from inside a call, and every kernel still runs on the one
    thread that OpenMP serves (a second thread would get a team of workers of its own). Each
    greenlet has its own context: the call's hooks (contextvars) stay with the call, and the
    generations' steps never see them.

        call = SteppedCall(lambda report: run_operation(model, op, report=report))
        while not call.advance():    # one slice: to the next report point, or the end
            ...                      # the generations' step, a heartbeat
        call.value / call.error
    """

    def __init__(self, fn: Callable[[Report], T]):
        self._fn = fn
        self._greenlet = greenlet.greenlet(self._body)
        # the call runs in a copy of its creator's context, as a plain call would
        self._greenlet.gr_context = contextvars.copy_context()
        self.stop_asked = False
        self.slices = 0  # slices run (report points reached, plus the last one)
        self.done = False
        self.value: T | None = None
        self.error: BaseException | None = None

    def _body(self) -> T:
        return self._fn(self.report)

    def report(self) -> None:
        """A report point (on the call's stack): back to the core until the next slice."""
        parent = self._greenlet.parent
        assert parent is not None  # the greenlet that started the call: the core's
        parent.switch()
        if self.stop_asked:
            raise CallCancelled("the caller went away")

    def advance(self) -> bool:
        """Run one slice of the call (on the caller's thread, which must be the one that made it).
        True once it has ended; then `value` or `error` holds what it gave."""
        if self.done:
            return True
        if self.stop_asked and not self._greenlet:  # stopped before it started: it never runs
            return self._end(error=CallCancelled("the caller went away"))
        self.slices += 1
        try:
            value = self._greenlet.switch()
        except BaseException as e:  # the call's exception (CallCancelled at a report point too)
            return self._end(error=e)
        if self._greenlet.dead:
            return self._end(value=value)
        return False

    def stop(self) -> None:
        """Its caller went away: the call raises CallCancelled at its next report point."""
        self.stop_asked = True

    def abandon(self) -> None:
        """The core is closing: unwind the call's stack now (its `finally` blocks run here)."""
        if not self.done and self._greenlet:
            self.stop_asked = True
            self.advance()

    def _end(self, value: T | None = None, error: BaseException | None = None) -> bool:
        self.done, self.value, self.error = True, value, error
        self._fn = _ended  # type: ignore[assignment]  # what it held is released with the call's frames
        return True


def _ended(report: Report) -> None:
    return None


class EngineCore:
    """The scheduler, the batch, the KV cache and the model calls (see the module docstring).
    Work comes in by add_generation / add_call (from any thread); run() steps until close()."""

    def __init__(self, checkpoint: Checkpoint, *, max_concurrent: int = 32, cuda_graphs: bool = True,
                 overlap_outputs: bool | None = None, kv_cache_bytes: int | None = None, prefill_chunk: int = 256,
                 prefill_chunk_alone: int | None = None, sink: OutputSink | None = None, call_slice_s: float = 0.1):
        self.checkpoint = checkpoint
        self.tokenizer = checkpoint.tokenizer
        self.config = checkpoint.config
        self.max_concurrent = max_concurrent
        self.sink: OutputSink = sink if sink is not None else (lambda records: None)
        self.model = checkpoint.model
        self.device = self.model.device
        self.dtype = self.model.dtype
        # On the CPU, with a byte budget, the KV cache hands out blocks from one pool of that many
        # bytes (model/paged_kv_cache.py) and prompts are admitted while their reservations fit
        # (Scheduler.fits); on CUDA (graphs capture fixed addresses), or for a family whose cache is not in
        # blocks, one row per slot is allocated whole and reused
        self.kv_budget = kv_cache_bytes
        # a family that does not generate (an encoder) has no cache and no generations: its core
        # runs model calls alone, with the same admission, progress and cancellation
        self.generates = family_of(self.model).generation is not None
        if not self.generates:
            self.max_concurrent = 0
            self.cache = None
        elif cache_paged(self.model, kv_cache_bytes, self.device):
            self.cache = self.model.new_kv_cache(max_concurrent, paged=True, pool_bytes=kv_cache_bytes)
        else:
            self.cache = self.model.new_kv_cache(max_concurrent)
        # a vocabulary padded past the tokenizer's last id (Qwen2): those ids are never sampled
        vocab = checkpoint.tokenizer.vocab_size
        self.vocab_limit = vocab if vocab < checkpoint.config.vocab_size else None
        # on CUDA: the decode step captured once per batch-size bucket, replayed every step (for
        # the families whose module offers a fixed-shape step, FixedShapeDecoder; the others decode
        # eagerly)
        self.graphs: GraphedDecoder | None = None
        if cuda_graphs and isinstance(self.cache, KVCache) and self.device.type == "cuda" \
                and isinstance(self.model, FixedShapeDecoder):
            try:
                self.graphs = GraphedDecoder(self.model, self.cache)
            except Exception:  # the eager step always works: use it
                log.warning("could not capture the decode step in CUDA graphs; decoding eagerly", exc_info=True)
                self.kv.reset()
        self._lock = threading.Lock()  # the inbox (handed-over work) and the closed flag
        self._wakeup = threading.Condition(self._lock)
        self._closed = False
        self._incoming: collections.deque[Generation] = collections.deque()  # handed over, not scheduled yet
        self._calls: collections.deque[CoreCall] = collections.deque()  # model calls waiting, oldest first
        self._call: tuple[CoreCall, SteppedCall[object]] | None = None  # the model call that runs, paused between slices
        # a call runs from report point to report point for this long before the generations get
        # their step: a stream beside it waits about this long, and the call pays one step for it
        self.call_slice_s = call_slice_s
        self._last_beat = 0.0  # when the last heartbeat went (time.monotonic)
        self._held_generations = 0  # handed over and not finished: at most max_concurrent
        # On CUDA a decode step's records are held until the next step has been launched, and
        # handed over while the device computes it: the output stage turns them into events in
        # that time instead of taking the GIL between this thread's launch calls (step).
        self._overlap_outputs = self.device.type == "cuda" if overlap_outputs is None else overlap_outputs
        self._held: list[CoreRecord] = []
        # which generations hold a row, which prompts are prefilled in a step, and in what pieces
        self.scheduler = Scheduler(self.cache, self.config.context_length, kv_budget=kv_cache_bytes, prefill_chunk=prefill_chunk,
                                   prefill_chunk_alone=prefill_chunk_alone)
        self.step_seconds = 0.0  # moving average of one decode step (0: not measured yet)
        self.errors = 0  # requests failed by an exception on the model thread
        self.cancelled = 0  # generations dropped from a slot because their client went away
        self.calls_cancelled = 0  # model calls stopped at a report point because their caller went away

    # --- counters ----------------------------------------------------------
    @property
    def kv(self) -> RowCache:
        """The KV cache, for the generations' work (only a model that generates has one)."""
        assert self.cache is not None, "a model that does not generate has no KV cache"
        return self.cache

    @property
    def cache_paged(self) -> bool:
        return isinstance(self.cache, BlockCache)

    @property
    def cache_bytes(self) -> int:
        """The most the KV cache may hold: the budget when it is in blocks, else what it
        holds (MAX_CONCURRENT rows x the context, every layer)."""
        if self.cache is None:
            return 0
        if self.cache_paged:
            return int(self.kv_budget or 0)
        return sum(t.numel() * t.element_size() for t in self.kv.keys + self.kv.values)

    @property
    def cache_held(self) -> int:
        """Bytes the KV cache holds now: the blocks in use when it is in blocks, else all of it."""
        return self.cache.bytes_held if isinstance(self.cache, BlockCache) else self.cache_bytes

    # --- what a client calls (any thread) ----------------------------------
    def add_generation(self, g: Generation) -> None:
        """A generation that has a slot: prefilled at a coming step. Its records go to the sink."""
        with self._lock:
            if self._held_generations >= self.max_concurrent:
                raise RuntimeError(f"the engine core holds {self._held_generations} generations, its most")
            self._held_generations += 1
            self._incoming.append(g)
            self._wakeup.notify()

    def cancel(self, g: Generation) -> None:
        """g's client went away: it ends ("cancelled") at the next step."""
        g.cancelled = True

    def stop(self, g: Generation) -> None:
        """The output stage found a stop string in g's text: it ends ("stop") at the next step."""
        g.stop_requested = True

    def add_call(self, call: CoreCall) -> None:
        """A model call: run once, in turn with the other calls, a slice a step; its CallResult goes
        to the sink."""
        with self._lock:
            self._calls.append(call)
            self._wakeup.notify()

    def cancel_call(self, call: CoreCall) -> None:
        """The call's caller went away: skipped if it waits, stopped at its next report point if it runs."""
        call.cancelled = True

    def close(self) -> None:
        """run() returns after its current step (what it holds is not ended: that is the front's)."""
        with self._lock:
            self._closed = True
            self._wakeup.notify()

    # --- the model's thread ------------------------------------------------
    def run(self) -> None:
        """Step until close(), waiting while there is nothing to do; then hand over what is held."""
        with torch.inference_mode():
            while True:
                with self._lock:
                    while not self._closed and not self._has_work():
                        self._wakeup.wait()
                    if self._closed:
                        break
                self.step()
        if self._call is not None:  # unwind the paused call on this thread (its caller is ended by the front)
            self._call[1].abandon()
            self._call = None
        self._deliver([])  # what is held goes before the end

    def _has_work(self) -> bool:
        return bool(self._incoming or self._calls or self._call is not None) or self.scheduler.has_work()

    def _deliver(self, records: list[CoreRecord]) -> None:
        """Hand over the held records, then these ones (in that order)."""
        if self._held:
            records, self._held = self._held + records, []
        if records:
            self.sink(records)

    def _deliver_held(self) -> None:
        """Called by decode_step once the step's kernels are launched, before it waits for them."""
        self._deliver([])

    def _heartbeat(self) -> None:
        self._last_beat = time.monotonic()
        self.sink([])

    def step(self) -> None:
        """One step: schedule, then execute (a slice of the model call, a prefill piece, a decode
        step), then update (hand the step's records to the sink)."""
        # torch's grad and inference modes are the thread's: a call paused inside its own (attribution
        # patching's autograd) leaves them so; the generations' work runs in inference mode all the same
        records: list[CoreRecord] = []
        with torch.inference_mode():
            self._schedule(records)
        if records:
            self._deliver(records)
            records = []
        if self._call is not None or self._calls:
            self._run_call_slice()
        with torch.inference_mode():
            self._run_generations(records)
        if self._overlap_outputs and self.scheduler.decoding:
            self._held.extend(records)  # handed over while the next step runs on the device
        else:
            self._deliver(records)

    def _run_generations(self, records: list[CoreRecord]) -> None:
        """This step's prefill piece or prompts, then one decode step of every decoding row."""
        if self.scheduler.chunking is not None:
            self._run_chunk(records)
        if self.scheduler.waiting and (batch := self.scheduler.next_prefills()):
            if self.scheduler.chunked(batch[0]):
                self._start_chunking(batch[0])
                self._run_chunk(records)
            else:
                self._run_prefills(batch, records)
        self._retire_finished(records)
        if self.scheduler.decoding:
            if records and not self._overlap_outputs:  # the prompts' first tokens go out now, not a decode step later
                self._deliver(records[:])  # a list of their own: the sink may read it after this step goes on
                records.clear()
            t0 = time.perf_counter()
            self._run_decode(records)
            self._note_step(time.perf_counter() - t0)
            self._retire_finished(records)

    def _note_step(self, seconds: float) -> None:
        self.step_seconds = seconds if self.step_seconds == 0 else 0.9 * self.step_seconds + 0.1 * seconds

    def _schedule(self, records: list[CoreRecord]) -> None:
        if self._incoming:  # read without the lock: a stale answer only waits one step
            with self._lock:
                self.scheduler.waiting.extend(self._incoming)
                self._incoming.clear()
        for g in [g for g in self.scheduler.decoding if g.cancelled or g.stop_requested]:
            self._retire(g, "stop" if g.stop_requested and not g.cancelled else "cancelled", records)
        for g in [g for g in self.scheduler.waiting if g.cancelled]:
            self.scheduler.waiting.remove(g)
            self._retire(g, "cancelled", records)
        if self.scheduler.chunking is not None and self.scheduler.chunking.cancelled:
            self._end_chunking("cancelled", records)

    def _run_call_slice(self) -> None:
        """Start the oldest waiting call if none runs, then run the running one to its next report
        point; its result goes to the sink once it ends."""
        if self._call is None:
            with self._lock:
                work = self._calls.popleft()
            if work.cancelled:  # its caller left while it waited
                self._deliver([CallResult(work, error=CallCancelled("the caller went away"))])
                return
            model, operation = self.model, work.operation
            self._call = (work, SteppedCall(lambda report: run_operation(model, operation, report=report)))
            self._last_beat = time.monotonic()
        work, call = self._call
        t0 = time.perf_counter()
        while True:
            if work.cancelled:
                call.stop()
            if call.advance():
                break
            if time.perf_counter() - t0 >= self.call_slice_s:
                if time.monotonic() - self._last_beat >= 1.0:
                    self._heartbeat()  # the watchdog's sign of progress while the call works
                return
        self._call = None
        if isinstance(call.error, CallCancelled):
            self.calls_cancelled += 1
            log.info("a model call stopped after %d slices (the last %.2f s): its caller went away",
                     call.slices, time.perf_counter() - t0)
            outcome = CallResult(work, error=call.error)
        elif call.error is not None:  # the call's failure is its own
            self.errors += 1
            log.error("model call failed", exc_info=call.error)
            outcome = CallResult(work, error=RuntimeError(MODEL_CALL_FAILED))
        else:
            outcome = CallResult(work, value=call.value)
        self._deliver([outcome])

    def _start_chunking(self, g: Generation) -> None:
        p = g.params
        row = len(self.scheduler.decoding)
        self.kv.free(row)
        g.t_start = time.perf_counter()
        g.sampler = RowSampler(p.sampling, make_generator(p.sampling.seed), p.n_logprobs, p.return_attention,
                               vocab_limit=self.vocab_limit)
        self.scheduler.chunking = g

    def _run_chunk(self, records: list[CoreRecord]) -> None:
        """The next piece of the long prompt being prefilled into row len(decoding); the last piece
        samples its first token and the generation joins the decoding ones."""
        g = self.scheduler.chunking
        assert g is not None  # called while a long prompt is being prefilled
        row = len(self.scheduler.decoding)
        ids = g.params.prompt_ids
        done = int(self.kv.lengths[row])
        size = self.scheduler.piece_size(others_waiting=bool(self._incoming))
        piece = torch.tensor([ids[done:done + size]], dtype=torch.long, device=self.device)
        rows = slice(row, row + 1)
        try:
            if done + size < len(ids):
                self.model(piece, kv_cache=self.kv, rows=rows, last_only=True)
                if not records and not self._held:
                    self._heartbeat()  # progress for the watchdog while nothing else decodes
                return
            step = decode_step(self.model, self.kv, piece, _samplers([g]), rows=rows, last_only=True)
        except Exception as e:
            self._fail(g, e)
            self._end_chunking("error", records)
            return
        self.scheduler.chunking = None
        self.scheduler.decoding.append(g)  # owns row `row`, the one after the decoding rows
        self._prefilled(g, step, 0, row, records)

    def _end_chunking(self, reason: str, records: list[CoreRecord]) -> None:
        g, self.scheduler.chunking = self.scheduler.chunking, None
        assert g is not None  # called while a long prompt is being prefilled
        self.kv.free(len(self.scheduler.decoding))
        self._retire(g, reason, records)

    def _run_prefills(self, batch: list[Generation], records: list[CoreRecord]) -> None:
        """Prefill these prompts into the next free rows (one right-padded forward); each
        generation then decodes with the others."""
        first = len(self.scheduler.decoding)
        if self.scheduler.chunking is not None:  # the long prompt's row (after the decoding ones) makes room
            self.kv.move(first, first + len(batch))
        for i, g in enumerate(batch):
            p = g.params
            self.kv.free(first + i)
            g.t_start = time.perf_counter()
            g.sampler = RowSampler(p.sampling, make_generator(p.sampling.seed), p.n_logprobs,
                                   p.return_attention, vocab_limit=self.vocab_limit)
            self.scheduler.decoding.append(g)  # owns row first + i from now on
        lengths = [len(g.params.prompt_ids) for g in batch]
        T = max(lengths)
        padded = [g.params.prompt_ids + [0] * (T - n) for g, n in zip(batch, lengths)]  # (B, T), pad id 0
        inputs = torch.tensor(padded, dtype=torch.long, device=self.device)
        rows = slice(first, first + len(batch))
        try:
            with hooked(self.model, self._hooks(batch, lengths if len(batch) > 1 else None)):
                if len(batch) == 1:
                    step = decode_step(self.model, self.kv, inputs, _samplers(batch[:1]), rows=rows,
                                       last_only=batch[0].params.prompt_logprobs is None)
                else:
                    step = decode_step(self.model, self.kv, inputs, _samplers(batch), rows=rows,
                                       n_new=lengths)
        except Exception as e:
            if len(batch) == 1:
                self._fail(batch[0], e)
                return
            for i, g in enumerate(batch):  # whose prompt fails? prefill them one by one
                one = slice(first + i, first + i + 1)
                self.kv.free(first + i)
                g.ablation_means.clear()
                try:
                    with hooked(self.model, self._hooks([g])):
                        alone = decode_step(self.model, self.kv, inputs[i : i + 1, : lengths[i]],
                                            _samplers([g]), rows=one)
                except Exception as e:
                    self._fail(g, e)
                    continue
                self._prefilled(g, alone, 0, first + i, records)
            return
        for i, g in enumerate(batch):
            self._prefilled(g, step, i, first + i, records)

    def _prefilled(self, g: Generation, step, index: int, row: int, records: list[CoreRecord]) -> None:
        if g.params.prompt_logprobs is not None:
            records.append(self._prompt_record(g, step.output.logits[index]))
        if g.params.max_new_tokens == 0:
            g.finish_reason = "length"
            return
        self._advance(g, step.tokens[index], int(self.kv.lengths[row]), records)

    def _prompt_record(self, g: Generation, logits: torch.Tensor) -> PromptRecord:
        ids = g.params.prompt_ids
        lp = torch.log_softmax(logits.float(), dim=-1)  # (T, V): row i predicts token i + 1
        targets = torch.tensor(ids[1:], dtype=torch.long, device=lp.device)
        chosen = lp[:-1].gather(1, targets[:, None])[:, 0].tolist() if len(ids) > 1 else []
        k = g.params.prompt_logprobs or 0
        top_ids, top_values = [], []
        if k > 0 and len(ids) > 1:
            top = torch.topk(lp[:-1], min(k, lp.shape[-1]), dim=-1)
            top_ids, top_values = top.indices.tolist(), top.values.tolist()
        return PromptRecord(g, chosen, top_ids, top_values)

    def _run_decode(self, records: list[CoreRecord]) -> None:
        rows = self.scheduler.decoding  # finished generations were retired: row i is rows[i]
        # (B, 1) ids; replayed CUDA graphs copy them in from the host with the rows' lengths
        inputs = torch.tensor([[g.last_token] for g in rows], dtype=torch.long,
                              device="cpu" if self.graphs is not None else self.device)
        before = self.kv.lengths[: len(rows)].tolist()
        hooks = self._hooks(rows)
        try:
            # a step with an ablated row runs eagerly (a captured graph has no hooks); its other rows
            # share that step, each with its own edits (none for most)
            with hooked(self.model, hooks):
                step = decode_step(self.model, self.kv, inputs, _samplers(rows),
                                   graphs=self.graphs if hooks is None else None, while_running=self._deliver_held)
        except Exception:
            # find whose input fails: decode the rows one by one from where they were (their
            # cache positions are written again)
            self.kv.lengths[: len(rows)] = torch.tensor(before)
            if self.graphs is not None:
                log.warning("a replayed CUDA graph step failed; decoding eagerly from now on", exc_info=True)
                self.graphs = None
            for i, g in enumerate(rows):
                try:
                    with hooked(self.model, self._hooks([g])):
                        one = decode_step(self.model, self.kv, inputs[i : i + 1], _samplers([g]),
                                          rows=slice(i, i + 1))
                except Exception as e:
                    self._fail(g, e)
                    continue
                self._advance(g, one.tokens[0], int(self.kv.lengths[i]), records)
            return
        for g, token, length in zip(rows, step.tokens, before):
            self._advance(g, token, length + 1, records)  # each row took one token

    @staticmethod
    def _hooks(gens: list[Generation], valid: list[int] | None = None):
        """One step's per-row ablations (model/hooks.py), or None when no row ablates."""
        return batch_hooks([g.params.ablate for g in gens], [g.ablation_means for g in gens], valid)

    def _advance(self, g: Generation, token, length: int, records: list[CoreRecord]) -> None:
        """Record g's new token; decide whether g is done (its row now holds `length` positions)."""
        g.produced += 1
        if g.t_first is None:
            g.t_first = time.perf_counter()
        g.last_token = token.id
        records.append(TokenRecord(g, token))
        if token.id in self.tokenizer.eos_ids and not g.params.ignore_eos:  # EOS, or another end (Llama 3's <|eot_id|>)
            g.finish_reason = "eos"
        elif g.produced >= g.params.max_new_tokens or length >= self.kv.capacity:
            g.finish_reason = "length"

    def _fail(self, g: Generation, error: Exception) -> None:
        """g ends with an error event; the others go on."""
        self.errors += 1
        log.error("generation %s failed", g.number, exc_info=error)
        g.finish_reason = "error"
        g.error_message = "internal error while generating; see the server log"  # details stay in the log

    def _retire_finished(self, records: list[CoreRecord]) -> None:
        for g, reason in [(g, g.finish_reason) for g in self.scheduler.decoding if g.finish_reason is not None]:
            self._retire(g, reason, records)

    def _retire(self, g: Generation, reason: str, records: list[CoreRecord]) -> None:
        """Free g's slot and cache row (the last row moves into it), then its final record."""
        if g in self.scheduler.decoding:
            row, last = self.scheduler.decoding.index(g), len(self.scheduler.decoding) - 1
            if row != last:
                self.kv.move(last, row)
                self.scheduler.decoding[row] = self.scheduler.decoding[last]
            else:
                self.kv.free(row)
            self.scheduler.decoding.pop()
            if self.scheduler.chunking is not None:  # the long prompt's row follows the decoding ones down
                self.kv.move(last + 1, last)
            # give back what the finished rows held, to the system too (freed tensors stay in the heap)
            if isinstance(self.cache, BlockCache) and self.cache.trim(len(self.scheduler.decoding) + (self.scheduler.chunking is not None)):
                heap.trim()
        g.t_end = time.perf_counter()
        if reason == "cancelled":
            self.cancelled += 1
        with self._lock:
            self._held_generations -= 1
        records.append(FinishRecord(g, reason, g.error_message))
