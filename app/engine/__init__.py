"""The inference engine: admission (scheduler, front), the model's side (core; in a process of
its own: process, worker, wire) and the output stage (outputs)."""

from .core import Engine, Generation, GenerationParams
from .front import EngineFront, ModelCall
from .outputs import GenerationCancelled
from .process import EngineProcess
from .scheduler import EngineClosed, QueueFull, RequestTooLarge

__all__ = ["Engine", "EngineClosed", "EngineFront", "EngineProcess", "Generation", "GenerationCancelled",
           "GenerationParams", "ModelCall", "QueueFull", "RequestTooLarge"]
