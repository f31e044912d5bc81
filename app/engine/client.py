"""The one interface between the engine's front and its core, and the in-process transport.

The front (front.py) admits requests and keeps their output state; the core (core.py) runs the
model. The front talks to the core only through a `CoreClient`: hand it the generations that
got a slot and the model calls in turn, cancel or stop them, read its counters, close it. The
client hands the core's records back to the front (a `FrontSink`), on a thread of its own.

Two transports (vLLM v1's InprocClient / SyncMPClient):
  InprocClient   the core on a thread of this process (below);
  ProcessClient  the core in an engine process of its own, over two pipes (process.py, with
                 worker.py and messages.py on the other side): the same EngineCore runs there.
"""

from __future__ import annotations

import abc
import queue
import threading
from typing import Protocol

import torch

from attnlens.app.engine.core import EngineCore
from attnlens.app.engine.records import CoreRecord
from attnlens.app.engine.request import CoreCall, Generation


class FrontSink(Protocol):
    """What a client tells the front (from its own thread, never the event loop's)."""

    # Where an in-process core puts its hand-overs of records (None: the front stops reading);
    # the front reads them on a thread of its own and calls on_records
    inbox: queue.SimpleQueue


    def on_records(self, records: list[CoreRecord]) -> None:
        """One hand-over of the core's records (empty: a heartbeat)."""

    def on_started(self) -> None:
        """A core runs and takes work (at start, and after each restart)."""

    def on_lost(self, detail: str) -> None:
        """The core went away (its process died) with everything it held; `detail` says why."""

    def generation(self, number: int) -> Generation | None:
        """The admitted generation with this number (None once it has ended): the front's registry."""

    def running_call(self, number: int) -> CoreCall | None:
        """The model call with this number while the core holds it (None once it has ended)."""


class CoreClient(abc.ABC):
    """The front's handle on a core (see the module docstring)."""

    restartable: bool = False  # the core can die and be started again (kill, restart)
    pid: int | None = None  # the core's process, where it has one of its own
    start_seconds: float = 0.0  # how long the core took to start, the last time

    @abc.abstractmethod
    def start(self, sink: FrontSink) -> None:
        """Start the core; its records and its life's events go to `sink`. May block (loading)."""

    # --- work --------------------------------------------------------------
    @abc.abstractmethod
    def add_generation(self, g: Generation) -> None:
        """A generation that has a slot (the front never hands over more than max_concurrent)."""

    @abc.abstractmethod
    def cancel(self, g: Generation) -> None:
        """g's client went away: the core ends it ("cancelled") at its next step."""

    @abc.abstractmethod
    def stop(self, g: Generation) -> None:
        """The output stage found a stop string: the core ends g ("stop") at its next step."""

    @abc.abstractmethod
    def add_call(self, call: CoreCall) -> None:
        """A model call; raises if it cannot be handed over (its operation does not pickle)."""

    @abc.abstractmethod
    def cancel_call(self, call: CoreCall) -> None:
        """The call's caller went away: it stops at its next report point."""

    # --- counters and health -----------------------------------------------
    device: torch.device
    dtype: torch.dtype

    @property
    @abc.abstractmethod
    def alive(self) -> bool:
        """The core runs (InprocClient: a plain attribute, set when its thread ends)."""

    def silent_for(self, now: float) -> float:
        """Seconds since the core last handed anything over (0 where nothing watches it: in-process)."""
        return 0.0

    @property
    @abc.abstractmethod
    def errors(self) -> int:
        """Requests failed by an exception in the core."""

    @property
    @abc.abstractmethod
    def cancelled(self) -> int:
        """Generations the core dropped from a slot because their client went away."""

    @property
    @abc.abstractmethod
    def cache_bytes(self) -> int: ...

    @property
    @abc.abstractmethod
    def cache_held(self) -> int: ...

    @property
    @abc.abstractmethod
    def step_seconds(self) -> float:
        """Moving average of one decode step (0: not measured yet)."""

    @property
    @abc.abstractmethod
    def cuda_graphs(self) -> bool: ...

    # --- life --------------------------------------------------------------
    @abc.abstractmethod
    def close(self, timeout: float = 10.0) -> None:
        """Stop the core once it has handed over what it holds; what it ran is the front's to end."""

    def kill(self, reason: str) -> None:
        """Stop the core at once (the watchdog); the sink's on_lost follows."""
        raise NotImplementedError("this engine's core cannot be killed")

    def restart(self) -> None:
        """Start a new core after the last one was lost. Blocks."""
        raise NotImplementedError("this engine's core cannot be restarted")


class InprocClient(CoreClient):
    """The core on a thread of this process. Its work methods are the core's own, bound here, so
    a hand-over is one call into the core; its records go into the front's inbox (a queue the
    front reads on a thread of its own), so the core never calls the front."""

    alive = True  # until the core's thread ends (set on that thread)

    def __init__(self, core: EngineCore):
        self.core = core
        self.device, self.dtype = core.device, core.dtype
        self.add_generation = core.add_generation  # type: ignore[method-assign]
        self.cancel = core.cancel  # type: ignore[method-assign]
        self.stop = core.stop  # type: ignore[method-assign]
        self.add_call = core.add_call  # type: ignore[method-assign]
        self.cancel_call = core.cancel_call  # type: ignore[method-assign]
        self._thread = threading.Thread(target=self._run, name="attnlens-engine", daemon=True)

    def _run(self) -> None:
        try:
            self.core.run()
        finally:
            self.alive = False  # type: ignore[misc]

    def start(self, sink: FrontSink) -> None:
        self.core.sink = sink.inbox.put
        sink.on_started()
        self._thread.start()

    # the work methods are bound to the core's in __init__; these only satisfy the interface
    def add_generation(self, g: Generation) -> None: ...
    def cancel(self, g: Generation) -> None: ...
    def stop(self, g: Generation) -> None: ...
    def add_call(self, call: CoreCall) -> None: ...
    def cancel_call(self, call: CoreCall) -> None: ...

    @property
    def errors(self) -> int:
        return self.core.errors

    @property
    def cancelled(self) -> int:
        return self.core.cancelled

    @property
    def cache_bytes(self) -> int:
        return self.core.cache_bytes

    @property
    def cache_held(self) -> int:
        return self.core.cache_held

    @property
    def step_seconds(self) -> float:
        return self.core.step_seconds

    @property
    def cuda_graphs(self) -> bool:
        return self.core.graphs is not None

    def close(self, timeout: float = 10.0) -> None:
        self.core.close()
        if self._thread.is_alive():
            self._thread.join(timeout)
