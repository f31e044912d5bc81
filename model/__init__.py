"""attnlens' transformer: config, model, tokenizer, checkpoints, decoding."""

from .checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from .config import ConfigError, ModelConfig
from .decoding import GeneratedToken, SamplingParams, generate_tokens
from .tokenizer import Tokenizer
from .kv_cache import ContextLengthError, KVCache
from .transformer import ModelOutput, Transformer

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "ConfigError",
    "ContextLengthError",
    "GeneratedToken",
    "KVCache",
    "ModelConfig",
    "ModelOutput",
    "SamplingParams",
    "Tokenizer",
    "Transformer",
    "generate_tokens",
    "load_checkpoint",
    "save_checkpoint",
]
