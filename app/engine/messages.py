"""What the server and an engine process say to each other over their two pipes: declared
msgspec Structs, one tagged union each way (vLLM v1's EngineCoreRequest / EngineCoreOutputs),
sent as msgpack and decoded by type (a message that is not one of the union's is refused whole).

    server -> engine process (ToEngine)         engine process -> server (FromEngine)
    Start        the spec, once, first          Ready         the model is loaded; what it runs on
    AddGeneration  a generation with a slot     Failed        the model could not be loaded
    CancelGeneration / StopGeneration           Step          one hand-over: counters and records
    AddCall      a model operation              CallDone      a model call's value or error
    CancelCall   its caller went away
    Close

A generation's records travel as TokenOut / PromptOut / FinishOut, keyed by the generation's
number in the server. Attention rows are numpy arrays (an msgpack extension: dtype, shape, raw
bytes). A model operation and a call's answer are plain data of many types (model/analysis/
operations.py): they travel pickled inside their message (`payload`). Times are
time.perf_counter() values, which on Linux share one clock across processes.
"""

from __future__ import annotations

import pickle
from multiprocessing.connection import Connection
from typing import Any, Union

import msgspec
import numpy as np

from attnlens.app.engine.request import GenerationParams


class EngineSpec(msgspec.Struct, frozen=True):
    """What the engine process loads and how it runs."""

    model_dir: str
    device: str = "auto"
    dtype: str = "auto"
    engine: dict[str, Any] = {}  # EngineCore's keyword arguments
    log_level: str = "info"
    malloc_retain_bytes: int = 0  # app/engine/allocator.py


class Counters(msgspec.Struct):
    """The engine process's own figures, sent with every hand-over."""

    step_seconds: float = 0.0  # moving average of one decode step
    errors: int = 0  # requests failed by an exception on the model thread
    cancelled: int = 0  # generations cancelled in the engine process (their client went away)
    cache_held: int = 0  # bytes the KV cache holds now (blocks in use; whole rows: all of it)


# --- server -> engine process ---------------------------------------------------------------
class Start(msgspec.Struct, tag="start"):
    spec: EngineSpec


class AddGeneration(msgspec.Struct, tag="add"):
    """A generation the server admitted into a free slot."""

    number: int
    params: GenerationParams


class CancelGeneration(msgspec.Struct, tag="cancel"):
    number: int


class StopGeneration(msgspec.Struct, tag="stop"):
    number: int


class AddCall(msgspec.Struct, tag="call"):
    """A model operation on the model-call line (pickled plain data: model/analysis/operations.py)."""

    number: int
    payload: bytes


class CancelCall(msgspec.Struct, tag="cancel_call"):
    """Its caller went away: it stops at its next report point."""

    number: int


class Close(msgspec.Struct, tag="close"):
    pass


ToEngine = Union[Start, AddGeneration, CancelGeneration, StopGeneration, AddCall, CancelCall, Close]


# --- engine process -> server ---------------------------------------------------------------
class EngineInfo(msgspec.Struct):
    device: str
    dtype: str
    cache_bytes: int
    cuda_graphs: bool


class Ready(msgspec.Struct, tag="ready"):
    info: EngineInfo


class Failed(msgspec.Struct, tag="failed"):
    message: str


class TokenOut(msgspec.Struct, tag="t", array_like=True):
    number: int
    id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]
    attention: list[Any] | None = None  # numpy arrays: the step's attention rows, per group
    cross_attention: list[Any] | None = None


class PromptOut(msgspec.Struct, tag="p", array_like=True):
    """log p(prompt token i | tokens < i) for i >= 1, with the top-k alternatives of each."""

    number: int
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


class FinishOut(msgspec.Struct, tag="f", array_like=True):
    number: int
    reason: str
    message: str
    produced: int
    t_start: float | None
    t_first: float | None
    t_end: float | None


RecordOut = Union[TokenOut, PromptOut, FinishOut]


class Step(msgspec.Struct, tag="step"):
    """One hand-over of the core's records (none: a heartbeat, the core is working)."""

    counters: Counters
    records: list[RecordOut]


class CallDone(msgspec.Struct, tag="result"):
    """A model call's end: `payload` is its pickled value when `ok`, else its pickled exception."""

    number: int
    ok: bool
    payload: bytes


FromEngine = Union[Ready, Failed, Step, CallDone]


# --- the bytes ----------------------------------------------------------------------------------
_ARRAY = 1  # msgpack extension code of a numpy array: (dtype, shape) header, then the raw bytes


def _encode_other(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        head = msgspec.msgpack.encode((obj.dtype.str, obj.shape))
        return msgspec.msgpack.Ext(_ARRAY, len(head).to_bytes(4, "little") + head + np.ascontiguousarray(obj).tobytes())
    raise NotImplementedError(f"{type(obj).__name__} does not travel between the server and an engine process")


def _decode_other(code: int, data: memoryview) -> Any:
    if code != _ARRAY:
        raise ValueError(f"unknown msgpack extension {code}")
    n = int.from_bytes(data[:4], "little")
    dtype, shape = msgspec.msgpack.decode(data[4:4 + n])
    return np.frombuffer(data[4 + n:], dtype=np.dtype(dtype)).reshape(shape).copy()


_encoder = msgspec.msgpack.Encoder(enc_hook=_encode_other)
_to_engine = msgspec.msgpack.Decoder(ToEngine, ext_hook=_decode_other)  # type: ignore[arg-type]
_from_engine = msgspec.msgpack.Decoder(FromEngine, ext_hook=_decode_other)  # type: ignore[arg-type]


def encode(message: ToEngine | FromEngine) -> bytes:
    """A message's bytes, made where it is made: one that cannot be encoded raises there."""
    return _encoder.encode(message)


def decode_to_engine(data: bytes) -> ToEngine:
    return _to_engine.decode(data)


def decode_from_engine(data: bytes) -> FromEngine:
    return _from_engine.decode(data)


def send(conn: Connection, message: ToEngine | FromEngine) -> None:
    conn.send_bytes(encode(message))


def pickled(value: object) -> bytes:
    """A model operation or a call's answer (plain data) for a message's payload."""
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def unpickled(payload: bytes) -> object:
    return pickle.loads(payload)
