"""The transformers architectures attnlens imports and exports, one module each.

A module declares one `ARCHITECTURE` (base.Architecture): its names, its config.json
translation both ways, the reasons a config cannot be written as it, and its weight-name
map. model/interop/convert.py does the rest for all of them. Adding an architecture is a
new module here and its name in REGISTERED.
"""

from __future__ import annotations

import importlib

from attnlens.model.interop.architectures.base import Architecture, Rule

REGISTERED = ("gpt2", "bert", "llama", "qwen2", "mistral", "gpt_neox", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "granite", "stablelm", "gptj", "mixtral")  # export-hf tries them in this order

ARCHITECTURES: tuple[Architecture, ...] = tuple(
    importlib.import_module(f".{name}", __name__).ARCHITECTURE for name in REGISTERED)

__all__ = ["ARCHITECTURES", "Architecture", "REGISTERED", "Rule"]
