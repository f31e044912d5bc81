"""What the engine core hands over: typed records about its generations and its model calls.

The core emits them to the output sink it was given (core.py); the front turns a generation's
records into its events (outputs.py) and a model call's result into its caller's answer; an
engine process sends them down its pipe first (messages.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from attnlens.model.decoding import GeneratedToken

if TYPE_CHECKING:
    from attnlens.app.engine.request import CoreCall, Generation

# What a model call's caller is told when it fails (the details stay in the server's log)
MODEL_CALL_FAILED = "internal error in a model call; see the server log"


@dataclass
class TokenRecord:
    generation: "Generation"
    token: GeneratedToken  # id, logprob, top alternatives, attention rows (tensors)


@dataclass
class PromptRecord:
    """log p(prompt token i | tokens < i) for i >= 1, with the top-k alternatives of each."""

    generation: "Generation"
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass
class FinishRecord:
    generation: "Generation"
    reason: str  # "length" | "eos" | "stop" | "cancelled" | "error"
    message: str = ""  # for "error"
    code: str | None = None  # for "error": machine-readable, e.g. engine_restarting
    retry_after: int | None = None  # for "error": seconds after which a retry may work


@dataclass
class CallResult:
    """A model call's end: its value (plain data), or the error its caller gets. `call` is the
    object the core was given."""

    call: "CoreCall"
    value: object = None
    error: BaseException | None = None


Record = Union[TokenRecord, PromptRecord, FinishRecord]
CoreRecord = Union[TokenRecord, PromptRecord, FinishRecord, CallResult]
