"""What an engine process and the server say to each other over their two pipes.

Server -> engine process, one pickled tuple per message:
  ("add", number, GenerationParams)   a generation the server admitted into a free slot
  ("cancel", number) / ("stop", number)
  ("call", number, operation)         a model operation on the model-call line (plain data:
                                      model/analysis/operations.py)
  ("cancel_call", number)              its caller went away: it stops at its next report point
  ("close",)

Engine process -> server:
  ("ready", info)                      once the model is loaded and its thread runs
  ("failed", message)                  the model could not be loaded
  ("step", Counters, [record, ...])    one hand-over of records (see encode_records)
  ("result", number, ok, value)        a model call's result, or its error message

Records travel as plain tuples and numpy arrays (pickled, never shared memory), keyed by the
generation's number in the server:
  ("t", number, id, logprob, top_ids, top_logprobs, attention, cross_attention)
  ("p", number, logprobs, top_ids, top_logprobs)
  ("f", number, reason, message, produced, t_start, t_first, t_end)
Times are time.perf_counter() values, which on Linux share one clock across processes.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from attnlens.app.engine.records import FinishRecord, PromptRecord, Record, TokenRecord
from attnlens.model.decoding import GeneratedToken


@dataclass
class Counters:
    """The engine process's own figures, sent with every hand-over."""

    step_seconds: float  # moving average of one decode step
    errors: int  # requests failed by an exception on the model thread
    cancelled: int  # generations cancelled in the engine process (their client went away)
    cache_held: int = 0  # bytes the KV cache holds now (blocks in use; whole rows: all of it)


def dumps(message: tuple) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def send(conn: Connection, message: tuple) -> None:
    conn.send_bytes(dumps(message))  # pickled whole first: a message that cannot pickle sends nothing


def receive(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _arrays(rows: list[torch.Tensor] | None):
    return None if rows is None else [r.numpy() for r in rows]


def _tensors(rows) -> list[torch.Tensor] | None:
    return None if rows is None else [torch.from_numpy(r) for r in rows]


def encode_records(records: list[Record]) -> list[tuple]:
    """In the engine process: records -> tuples (the generation's number in the server)."""
    out: list[tuple] = []
    for r in records:
        g = r.generation
        if isinstance(r, TokenRecord):
            t = r.token
            out.append(("t", g.number, t.id, t.logprob, t.top_ids, t.top_logprobs, _arrays(t.attention),
                        _arrays(t.cross_attention)))
        elif isinstance(r, PromptRecord):
            out.append(("p", g.number, r.logprobs, r.top_ids, r.top_logprobs))
        else:
            out.append(("f", g.number, r.reason, r.message, g.produced, g.t_start, g.t_first, g.t_end))
    return out


def decode_record(item: tuple, generation) -> Record:
    """In the server: one tuple -> the record for its generation (whose counters it updates)."""
    kind = item[0]
    if kind == "t":
        _, _, id, logprob, top_ids, top_logprobs, attention, cross = item
        generation.produced += 1
        return TokenRecord(generation, GeneratedToken(id, logprob, top_ids, top_logprobs, _tensors(attention),
                                                      _tensors(cross)))
    if kind == "p":
        return PromptRecord(generation, *item[2:])
    _, _, reason, message, produced, t_start, t_first, t_end = item
    generation.produced, generation.t_start, generation.t_first, generation.t_end = produced, t_start, t_first, t_end
    return FinishRecord(generation, reason, message)
