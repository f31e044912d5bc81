"""GPT-2 (GPT2LMHeadModel): attnlens' own decoders are GPT-2-shaped. Its converters predate
this package and live in model/interop/hf.py (Conv1D weights stored transposed, learned
positions, a tied head); this module registers them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnlens.model.checkpoint import CheckpointError
from attnlens.model.config import ModelConfig
from attnlens.model.interop import hf
from attnlens.model.interop.architectures.base import Architecture


def import_dir(src: Path, out: Path, cap: int | None = None) -> Path:
    if cap is not None:
        raise CheckpointError(f"{src}: a context-length cap is for rotary-position models; GPT-2's "
                              "learned positions are part of its weights")
    return hf.import_hf(src, out)


def config_from_hf(data: dict[str, Any], path: Path, cap: int | None = None) -> ModelConfig:
    return hf.config_from_gpt2(data, path)


ARCHITECTURE = Architecture(
    name="gpt2", title="GPT-2", hf_class="GPT2LMHeadModel", model_type="gpt2",
    config_from_hf=config_from_hf, config_to_hf=lambda config: hf.gpt2_config_dict(config, None),
    export_reasons=ModelConfig.is_gpt2_shaped,
    also_accepts=None,  # any GPT-2 directory with GPT2LMHeadModel's weights, as before this package
    import_dir=import_dir, export_dir=hf.export_hf,
)
