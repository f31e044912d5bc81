"""The inference engine, as a composition:

    front (front.py) --CoreClient (client.py)--> core (core.py)

* the front, on the server's side: admission (its two bounded lines: QueueFull, Retry-After,
  RequestTooLarge), each request's output state (outputs.py: its events, as the engine's own
  dataclasses; app/serving/generation_streams.py makes the API's schemas of them) and the stream budget;
* the core: the one owner of the model (the scheduler, the batch, the KV cache, model calls), stepping on its own
  thread and emitting typed records (records.py) to a sink;
* one client interface with two transports: InprocClient (the core on a thread of this
  process) and ProcessClient (process.py: the same core in an engine process of its own,
  worker.py, over pipes, in the typed messages of messages.py).

Engine(...) and EngineProcess(...) (engines.py) build the two; supervisor.py restarts a lost
engine process.
"""

from attnlens.app.engine.core import EngineCore, Generation, GenerationParams
from attnlens.app.engine.engines import Engine, EngineProcess
from attnlens.app.engine.front import EngineClosed, EngineFront, ModelCall, QueueFull, RequestTooLarge
from attnlens.app.engine.outputs import GenerationCancelled, RequestState

__all__ = ["Engine", "EngineClosed", "EngineCore", "EngineFront", "EngineProcess", "Generation",
           "GenerationCancelled", "GenerationParams", "ModelCall", "QueueFull", "RequestState", "RequestTooLarge"]
