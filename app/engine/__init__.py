"""The inference engine: admission (scheduler), the model thread (core), the output stage (outputs)."""

from .core import Engine, Generation, GenerationParams, ModelCall
from .outputs import GenerationCancelled
from .scheduler import EngineClosed, QueueFull, RequestTooLarge

__all__ = ["Engine", "EngineClosed", "Generation", "GenerationCancelled", "GenerationParams", "ModelCall",
           "QueueFull", "RequestTooLarge"]
