"""BERT (BertForMaskedLM): attnlens' encoders are BERT-shaped. Its converters predate this
package and live in model/interop/hf_bert.py (q/k/v split, token-type row folded into the
positions, the MLM head); this module registers them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnlens.model.checkpoint import CheckpointError
from attnlens.model.config import ModelConfig
from attnlens.model.interop import hf_bert
from attnlens.model.interop.architectures.base import Architecture


def import_dir(src: Path, out: Path, cap: int | None = None) -> Path:
    if cap is not None:
        raise CheckpointError(f"{src}: a context-length cap is for rotary-position models; BERT's "
                              "learned positions are part of its weights")
    return hf_bert.import_bert(src, out)


def config_from_hf(data: dict[str, Any], path: Path, cap: int | None = None) -> ModelConfig:
    return hf_bert.config_from_bert(data, path)


ARCHITECTURE = Architecture(
    name="bert", title="BERT", hf_class="BertForMaskedLM", model_type="bert",
    config_from_hf=config_from_hf, config_to_hf=lambda config: hf_bert.bert_config_dict(config, None),
    export_reasons=ModelConfig.is_bert_shaped,
    also_accepts=None,  # any BERT directory holding BertForMaskedLM's tensors, as before this package
    import_dir=import_dir, export_dir=hf_bert.export_bert,
)
