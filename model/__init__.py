"""attnlens' transformer: config, model, tokenizer, checkpoints, decoding.

Layout: the core every family uses sits here (config, parts, kv_cache, cuda_graphs, tokenizer,
checkpoint, decoding); families/ holds the decoder, encoder and encoder-decoder models and the
family -> class map; data/ the corpora; training/ the training loop and objectives;
evaluation/ the reports; interop/ Hugging Face export and import.
"""

from attnlens.model.checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from attnlens.model.config import ConfigError, ContextLengthError, ModelConfig
from attnlens.model.decoding import GeneratedToken, SamplingParams, generate_tokens
from attnlens.model.families import DecoderOutput, Family, Transformer, family_of
from attnlens.model.kv_cache import KVCache
from attnlens.model.tokenizer import Tokenizer

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "ConfigError",
    "ContextLengthError",
    "GeneratedToken",
    "KVCache",
    "ModelConfig",
    "DecoderOutput",
    "Family",
    "SamplingParams",
    "Tokenizer",
    "Transformer",
    "family_of",
    "generate_tokens",
    "load_checkpoint",
    "save_checkpoint",
]
