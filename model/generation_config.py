"""A checkpoint's recommended sampling, from transformers' generation_config.json.

A request that leaves a sampling field unset gets the model's recommended value, as vLLM's
`--generation-config auto` does; each field on its own (a request that sets only temperature
keeps the model's top_p: model/sampling.py's `choose`). What generation_config.json says, field by field:

    do_sample: false    greedy (temperature 0): transformers then ignores temperature, top_p, top_k
    temperature         as it is (0: greedy)
    top_p               as it is (1: every token)
    top_k               as it is (0 or less: every token)

Fields that change sampling but have no counterpart here (repetition_penalty, min_p, typical_p,
beams, max_new_tokens) are not applied: `not_applied` names them, and the server's log says so.
A value of the wrong type or out of range is not applied either. A file with none of these
fields recommends nothing: the API's own defaults apply.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnlens.model.sampling import SamplingDefaults  # the fields a file recommends

GENERATION_CONFIG_FILE = "generation_config.json"
# transformers' fields that change what is sampled, with their neutral values (a file that sets
# one to another value is told it is not applied)
NOT_APPLIED = {"repetition_penalty": 1.0, "min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0,
               "eta_cutoff": 0.0, "no_repeat_ngram_size": 0, "num_beams": 1, "penalty_alpha": None,
               "max_new_tokens": None}


@dataclass(frozen=True)
class ModelSampling:
    """What a checkpoint recommends (`defaults`) and what of its file is not applied."""

    defaults: SamplingDefaults = SamplingDefaults()
    not_applied: dict[str, Any] = field(default_factory=dict)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def sampling_of(config: dict[str, Any]) -> ModelSampling:
    """The recommended sampling in a generation_config.json's fields (see the module's table)."""
    bad: dict[str, Any] = {}
    if config.get("do_sample") is False:
        chosen = SamplingDefaults(temperature=0.0)
    else:
        values: dict[str, Any] = {}
        temperature, top_p, top_k = (config.get(k) for k in ("temperature", "top_p", "top_k"))
        if temperature is not None:
            if _number(temperature) and temperature >= 0:
                values["temperature"] = float(temperature)
            else:
                bad["temperature"] = temperature
        if top_p is not None:
            if _number(top_p) and 0 < top_p <= 1:
                values["top_p"] = float(top_p)
            else:
                bad["top_p"] = top_p
        if top_k is not None:
            if isinstance(top_k, int) and not isinstance(top_k, bool):
                values["top_k"] = max(top_k, 0)
            else:
                bad["top_k"] = top_k
        chosen = SamplingDefaults(**values)
    for key, neutral in NOT_APPLIED.items():
        if config.get(key, neutral) != neutral:
            bad[key] = config[key]
    return ModelSampling(chosen, bad)


def read_generation_config(directory: str | Path) -> dict[str, Any]:
    """A directory's generation_config.json ({} when there is none). Raises ValueError naming the
    file when it is not a JSON object."""
    path = Path(directory) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def read_sampling(directory: str | Path) -> ModelSampling:
    """The checkpoint directory's recommended sampling (its generation_config.json)."""
    return sampling_of(read_generation_config(directory))


def write_generation_config(directory: str | Path, fields: dict[str, Any]) -> None:
    """Put `fields` into the directory's generation_config.json (made when missing; its other fields
    kept), written whole then moved into place: a server reading it meanwhile sees the old or the new."""
    path = Path(directory) / GENERATION_CONFIG_FILE
    data = {**read_generation_config(directory), **fields}
    tmp = path.with_name(f".{GENERATION_CONFIG_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


def copy_generation_config(src_dir: str | Path, out_dir: str | Path) -> None:
    """An imported transformers directory's generation_config.json into the checkpoint made from it
    (`out_dir`): every field but the token ids, which the checkpoint's tokenizer has read and writes
    there itself (its stop ids: model/tokenizer.py)."""
    source = {k: v for k, v in read_generation_config(src_dir).items() if not k.endswith("_token_id")}
    if source:
        write_generation_config(out_dir, source)
