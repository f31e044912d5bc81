"""A generation request as the engine sees it: what to generate (GenerationParams) and the
core's state for it (Generation). The front makes one per admitted generation; in an engine
process the worker makes its own copy of each from the parameters sent down the pipe."""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from attnlens.model import SamplingParams
from attnlens.model.hooks import ZEdit

if TYPE_CHECKING:
    from attnlens.model.analysis.operations import Operation
    from attnlens.model.decoding import RowSampler

_numbers = itertools.count(1)
_call_numbers = itertools.count(1)


@dataclass
class GenerationParams:
    """What to generate; validated by the caller (lengths fit the context)."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    n_logprobs: int = 0
    return_attention: bool = False
    prompt_logprobs: int | None = None  # also score the prompt tokens (OpenAI echo), with this many alternatives
    # heads to ablate in this generation's row only (model/hooks.py, resolved and checked by the caller);
    # a mean ablation holds the prompt positions' mean, taken at prefill, for every decode step
    ablate: tuple[ZEdit, ...] = ()
    # run to max_new_tokens past an EOS (vLLM's ignore_eos): benchmarks that need every stream's length
    ignore_eos: bool = False


class GenerationOwner(Protocol):
    """Who admitted a generation (the engine's front): told when it is cancelled or must stop."""

    def cancel_generation(self, g: "Generation") -> None: ...

    def stop_generation(self, g: "Generation") -> None: ...


class Generation:
    """One generation request, from admission to its end: what to generate and the core's state
    for it (row sampler, counters, times). Its server-side state (event loop, output stage,
    client) is a RequestState (outputs.py) that the front finds by `number`."""

    def __init__(self, params: GenerationParams):
        self.number = next(_numbers)
        self.id = f"gen-{uuid.uuid4().hex[:24]}"
        self.params = params
        self.cancelled = False  # the client went away
        self.stop_requested = False  # the output stage found a stop string
        self.owner: GenerationOwner | None = None  # the front that admitted it (none in an engine process)
        # the core's state
        self.sampler: RowSampler | None = None
        self.ablation_means: dict = {}  # (module, head) -> the prompt's mean z, for mean ablation
        self.last_token: int | None = None
        self.produced = 0  # tokens generated, a final EOS included
        self.finish_reason: str | None = None  # set by the core when it is done
        self.error_message = ""
        self.t_submit = time.perf_counter()
        self.t_start: float | None = None
        self.t_first: float | None = None
        self.t_end: float | None = None

    @property
    def row_sampler(self) -> RowSampler:
        """Its row's sampler: the core makes it before the generation's first forward."""
        assert self.sampler is not None, f"generation {self.number} was not started by the core"
        return self.sampler

    def cancel(self) -> None:
        """Stop this generation (a no-op once it has finished); a waiting one leaves the line now."""
        if self.cancelled:
            return
        self.cancelled = True
        if self.owner is not None:
            self.owner.cancel_generation(self)

    def stop(self) -> None:
        """The output stage found a stop string (or the client fell behind): end at the next step."""
        if self.stop_requested:
            return
        self.stop_requested = True
        if self.owner is not None:
            self.owner.stop_generation(self)


class CoreCall:
    """A model call as the core sees it: the operation to run (plain data:
    model/analysis/operations.py), its number (an engine process's calls are keyed by the
    server's), and whether its caller went away."""

    def __init__(self, operation: "Operation[object]", number: int | None = None):
        self.operation = operation
        self.number = next(_call_numbers) if number is None else number
        self.cancelled = False
