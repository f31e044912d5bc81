"""The two ways to build an engine: a front over one of the two transports to the same core.

    Engine(checkpoint, **limits)         EngineFront(client=InprocClient(EngineCore(...)))
    EngineProcess(checkpoint, model_dir=..., device=..., dtype=..., **limits)
                                         EngineFront(client=ProcessClient(spec)), whose engine
                                         process runs EngineCore(...) (worker.py)
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from attnlens.app.engine.client import InprocClient
from attnlens.app.engine.core import EngineCore
from attnlens.app.engine.front import EngineFront
from attnlens.app.engine.messages import EngineSpec
from attnlens.app.engine.process import ProcessClient
from attnlens.model import Checkpoint


def Engine(checkpoint: Checkpoint, *, max_concurrent: int = 32, max_queue: int = 64,
           max_attention_concurrent: int = 4, cuda_graphs: bool = True, max_stream_backlog_bytes: int = 64_000_000,
           overlap_outputs: bool | None = None, kv_cache_bytes: int | None = None, prefill_chunk: int = 256,
           prefill_chunk_alone: int | None = None, calls_limit: str = "ATTNLENS_MAX_ATTENTION_CONCURRENT",
           clock: Callable[[], float] = time.monotonic) -> EngineFront:
    """An engine whose core runs on a thread of this process, on this checkpoint's model (a model
    that does not generate gets no KV cache and no generation slots: model calls only)."""
    core = EngineCore(checkpoint, max_concurrent=max_concurrent, cuda_graphs=cuda_graphs,
                      overlap_outputs=overlap_outputs, kv_cache_bytes=kv_cache_bytes, prefill_chunk=prefill_chunk,
                      prefill_chunk_alone=prefill_chunk_alone)
    return EngineFront(checkpoint, InprocClient(core), max_concurrent=core.max_concurrent, max_queue=max_queue,
                       max_attention_concurrent=max_attention_concurrent,
                       max_stream_backlog_bytes=max_stream_backlog_bytes, calls_limit=calls_limit, clock=clock)


def EngineProcess(checkpoint: Checkpoint, *, model_dir: Path | None = None, device: str = "auto",
                  dtype: str = "auto", max_concurrent: int = 32, max_queue: int = 64,
                  max_attention_concurrent: int = 4, cuda_graphs: bool = True,
                  max_stream_backlog_bytes: int = 64_000_000, overlap_outputs: bool | None = None,
                  kv_cache_bytes: int | None = None, prefill_chunk: int = 256,
                  prefill_chunk_alone: int | None = None, log_level: str = "info", malloc_retain_bytes: int = 0,
                  start_timeout_s: float = 600.0, clock: Callable[[], float] = time.monotonic) -> EngineFront:
    """An engine whose core runs in an engine process of its own, which loads the model from
    `model_dir` (the checkpoint's directory by default) onto `device` as `dtype`; this process
    keeps `checkpoint` for its tokenizer and configuration; with malloc_retain_bytes it keeps that much freed
    memory for its next forwards (allocator.py). Blocks until the model is loaded."""
    model_dir = model_dir or checkpoint.path
    if model_dir is None:
        raise ValueError("an engine process loads its model from a checkpoint directory; this one has none")
    spec = EngineSpec(str(model_dir), device, dtype, dict(
        max_concurrent=max_concurrent, cuda_graphs=cuda_graphs, overlap_outputs=overlap_outputs,
        kv_cache_bytes=kv_cache_bytes, prefill_chunk=prefill_chunk, prefill_chunk_alone=prefill_chunk_alone), log_level,
        malloc_retain_bytes)
    client = ProcessClient(spec, start_timeout_s=start_timeout_s, clock=clock)
    return EngineFront(checkpoint, client, max_concurrent=max_concurrent, max_queue=max_queue,
                       max_attention_concurrent=max_attention_concurrent,
                       max_stream_backlog_bytes=max_stream_backlog_bytes, clock=clock)
