"""A generation request as the engine sees it: what to generate (GenerationParams) and the
core's state for it (Generation). The front makes one per admitted generation; in an engine
process the worker makes its own copy of each from the parameters sent down the pipe."""

from __future__ import annotations

import itertools
import time
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


@dataclass(eq=False)
class Generation:
    """One generation request, from admission to its end: what to generate and the core's state
    for it (row sampler, counters, times). Its server-side state (event loop, output stage,
    client) is a RequestState (outputs.py) that the front finds by `number`. A plain dataclass:
    making one runs no code of this module's (the front names it: `id`)."""

    params: GenerationParams
    number: int = field(default_factory=_numbers.__next__)
    id: str = ""  # "gen-...": given by the front that admits it
    cancelled: bool = False  # the client went away
    stop_requested: bool = False  # the output stage found a stop string
    owner: GenerationOwner | None = None  # the front that admitted it (none in an engine process)
    # the core's state
    sampler: RowSampler | None = None  # its row's sampler: the core makes it before its first forward
    ablation_means: dict = field(default_factory=dict)  # (module, head) -> the prompt's mean z, for mean ablation
    last_token: int | None = None
    produced: int = 0  # tokens generated, a final EOS included
    finish_reason: str | None = None  # set by the core when it is done
    error_message: str = ""
    t_submit: float = field(default_factory=time.perf_counter)
    t_start: float | None = None
    t_first: float | None = None
    t_end: float | None = None

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


@dataclass(eq=False)
class CoreCall:
    """A model call as the core sees it: the operation to run (plain data:
    model/analysis/operations.py), its number (an engine process's calls are keyed by the
    server's), and whether its caller went away."""

    operation: Operation[object]
    number: int = field(default_factory=_call_numbers.__next__)
    cancelled: bool = False
