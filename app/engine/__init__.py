"""The inference engine: admission (scheduler, front), the model's side (core; in a process of
its own: process, worker, wire) and the output stage (outputs: each request's server-side
state and its events, as the engine's own dataclasses; app/stream_events.py makes the API's
schemas of them)."""

from .core import Engine, Generation, GenerationParams
from .front import EngineFront, ModelCall
from .outputs import GenerationCancelled, RequestState
from .process import EngineProcess
from .scheduler import EngineClosed, QueueFull, RequestTooLarge

__all__ = ["Engine", "EngineClosed", "EngineFront", "EngineProcess", "Generation", "GenerationCancelled",
           "GenerationParams", "ModelCall", "QueueFull", "RequestState", "RequestTooLarge"]
