"""GGUF files (llama.cpp's format) as a source for `import-hf`: the same converter as a
transformers directory, fed from a different reader.

A GGUF file holds the config as metadata under llama.cpp's key names, the tokenizer as
metadata arrays, and the weights in ggml's block formats. `read_gguf` turns the three into
what a transformers directory gives the converter (model/interop/convert.py):

    config      a config.json dict: architectures, model_type, sizes, rope, norm epsilon,
                tied or untied head, special ids (from `{arch}.*` and `tokenizer.ggml.*`)
    tensors     float32 tensors under transformers' names (token_embd -> model.embed_tokens,
                blk.i.attn_q -> model.layers.i.self_attn.q_proj, ...), dequantized by the `gguf`
                package (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants), with
                llama.cpp's row permutation of Q and K undone for llama-architecture files
    tokenizer   model/interop/gguf_tokenizer.py
    blocks      the Q4_0, Q4_1 and Q8_0 tensors again as their blocks (uint8, one row of blocks
                per weight row, the same un-permutation), for serving them packed (model/packed/)

Supported: `general.architecture` llama (a llama file whose name says Mistral is imported as
Mistral, as transformers does), qwen2, gemma2, gemma3 (text), phi3 (LongRoPE's rope_factors
refused). Everything else, and every unreadable file, is a
CheckpointError naming what is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from attnlens.model.checkpoint import CheckpointError
from attnlens.model.tokenizer import Tokenizer

GGUF_MAGIC = b"GGUF"

# general.architecture -> (transformers class, model_type, Q/K rows permuted by llama.cpp's converter)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "mistral": ("MistralForCausalLM", "mistral", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "gemma2": ("Gemma2ForCausalLM", "gemma2", False),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text", False),
    "phi3": ("Phi3ForCausalLM", "phi3", False),
}
GEMMAS = ("gemma2", "gemma3")  # llama.cpp stores their norms as 1 + w (transformers' w: subtracted here)
# block formats `gguf.quants.dequantize` turns into float32 here
DEQUANTIZED = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
               "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# llama.cpp's tensor names -> transformers' (per layer: blk.{i}.<name>)
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # Gemma 2 / 3: the norms after each sub-layer and Gemma 3's per-head q/k norms
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
# where an architecture's names differ: Gemma's ffn_norm is the norm before the MLP (its
# post_attention_norm the one after attention); Phi-3's q|k|v and gate|up are one tensor each
LAYER_NAMES_OF = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}


@dataclass
class GGUFSource:
    """What a GGUF file holds, in the shapes the converter reads from a transformers directory."""

    path: Path
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    quantizations: dict[str, int]  # block format -> how many tensors use it (for the report)
    blocks: dict[str, tuple[torch.Tensor, str]]  # name -> (rows, row bytes) uint8 and format, for model/packed/


def open_reader(path: Path):
    """A gguf.GGUFReader on `path`; a file that is not GGUF, or is cut short, is a CheckpointError."""
    try:
        from gguf import GGUFReader
    except ImportError as e:  # the `model` extra brings it
        raise CheckpointError("reading a .gguf file needs the `gguf` package: pip install 'attnlens[model]'") from e
    if not path.is_file():
        raise CheckpointError(f"{path}: file does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        return GGUFReader(str(path))
    except Exception as e:  # truncated: numpy's memmap or the reader's own checks
        raise CheckpointError(f"{path}: cannot be read as GGUF, truncated or corrupt ({type(e).__name__}: {e})") from e


def metadata(reader) -> dict[str, Any]:
    """Every metadata field as a Python value (strings, numbers, lists of them)."""
    out = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except Exception:  # a field the reader cannot decode: leave it out, a needed one is named later
            continue
    return out


def read_gguf(path: str | Path, *, progress: Callable[[int, int], None] | None = None) -> GGUFSource:
    """Read a GGUF file into a config.json dict, float32 tensors under transformers' names and a
    Tokenizer. `progress(done, total)` is called after each tensor."""
    from attnlens.model.interop.gguf_tokenizer import tokenizer_from_metadata

    path = Path(path)
    reader = open_reader(path)
    meta = metadata(reader)
    arch_name = meta.get("general.architecture")
    if arch_name not in ARCHITECTURES:
        raise CheckpointError(f"{path}: GGUF architecture {arch_name!r} is not supported "
                              f"(supported: {', '.join(ARCHITECTURES)})")
    if arch_name == "llama" and "mistral" in str(meta.get("general.name", "")).lower():
        arch_name = "mistral"  # llama.cpp writes Mistral models as llama; so does transformers' reader
    names = [t.name for t in reader.tensors]
    config = config_from_metadata(meta, names, path, arch_name)
    tokenizer = tokenizer_from_metadata(meta, path)
    permuted = ARCHITECTURES[arch_name][2]
    tensors, formats = read_tensors(reader, config, path, permuted=permuted, progress=progress, arch=arch_name)
    return GGUFSource(path, config, tensors, tokenizer, formats,
                      read_blocks(reader, config, path, permuted=permuted, arch=arch_name))


def config_from_metadata(meta: dict[str, Any], tensor_names: list[str], path: Path, arch_name: str) -> dict[str, Any]:
    """A transformers config.json dict from `{arch}.*` metadata (the file's own architecture
    prefix: a Mistral file's keys are llama.*)."""
    prefix = meta["general.architecture"]
    hf_class, model_type, _ = ARCHITECTURES[arch_name]

    def need(key: str) -> Any:
        full = f"{prefix}.{key}"
        if full not in meta:
            raise CheckpointError(f"{path}: GGUF metadata {full!r} is missing")
        return meta[full]

    tokens = meta.get("tokenizer.ggml.tokens")
    n_vocab = meta.get(f"{prefix}.vocab_size", len(tokens) if isinstance(tokens, list) else None)
    if n_vocab is None:
        raise CheckpointError(f"{path}: GGUF metadata gives no vocabulary ({prefix}.vocab_size or tokenizer.ggml.tokens)")
    d_model, n_heads = need("embedding_length"), need("attention.head_count")
    config: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": n_vocab,
        "hidden_size": d_model,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": meta.get(f"{prefix}.attention.head_count_kv", n_heads),
        "max_position_embeddings": need("context_length"),
        "rms_norm_eps": need("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta.get(f"{prefix}.rope.freq_base", 10000.0),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    head_dim = meta.get(f"{prefix}.attention.key_length")
    if head_dim is not None:
        config["head_dim"] = head_dim
    rotary = meta.get(f"{prefix}.rope.dimension_count")
    per_head = head_dim or (d_model // n_heads if isinstance(d_model, int) and n_heads else None)
    if rotary is not None and per_head and rotary != per_head:
        config["partial_rotary_factor"] = rotary / per_head  # refused by the architecture, by name
    scaling = meta.get(f"{prefix}.rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {"rope_type": scaling, "factor": meta.get(f"{prefix}.rope.scaling.factor"),
                                  "original_max_position_embeddings":
                                      meta.get(f"{prefix}.rope.scaling.original_context_length")}
    if "rope_freqs.weight" in tensor_names:
        raise CheckpointError(f"{path}: GGUF tensor rope_freqs.weight (llama.cpp's per-frequency rope "
                              "factors, as for Llama 3.1) is not supported")
    if any(n.startswith("rope_factors_") for n in tensor_names):
        raise CheckpointError(f"{path}: GGUF tensors rope_factors_long / rope_factors_short (LongRoPE, the long-context "
                              "Phi-3 models' rope scaling) are not supported")
    window = meta.get(f"{prefix}.attention.sliding_window")
    if window is not None and arch_name in ("mistral", "phi3"):
        config["sliding_window"] = window
    if arch_name in GEMMAS:
        config.update(gemma_config(meta, prefix, config, window))
    if any(n.endswith(".attn_q.bias") for n in tensor_names) and arch_name == "llama":
        config["attention_bias"] = True
    return config


def gemma_config(meta: dict[str, Any], prefix: str, config: dict[str, Any], window: Any) -> dict[str, Any]:
    """A Gemma 2 / 3 file's config.json keys as llama.cpp reads its metadata: the soft-caps; the
    scores' scale 1/sqrt(head_dim), but 1/sqrt(hidden / heads) for the 27B models (46 layers: Gemma
    2, 62: Gemma 3), which llama.cpp knows by their size; Gemma 2's layers sliding and full in turn
    from the first, Gemma 3's five sliding to one full; Gemma 3's sliding layers rotating by base
    10000 unscaled, its full ones by rope.freq_base with the file's linear scaling."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    big = config["num_hidden_layers"] == (46 if prefix == "gemma2" else 62)
    n = config["num_hidden_layers"]
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": config["hidden_size"] // config["num_attention_heads"] if big else head_dim,
        "attn_logit_softcapping": meta.get(f"{prefix}.attn_logit_softcapping"),
        "final_logit_softcapping": meta.get(f"{prefix}.final_logit_softcapping"),
        "sliding_window": window,
        "layer_types": ["sliding_attention" if (i % 2 == 0 if prefix == "gemma2" else i % 6 < 5) else "full_attention"
                        for i in range(n)],
    }
    if prefix == "gemma3":
        full: dict[str, Any] = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
        scaling = config.pop("rope_scaling", None)
        if scaling is not None:
            full.update(rope_type=scaling["rope_type"], factor=scaling["factor"])
        out["rope_parameters"] = {"full_attention": full,
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    return out


def unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert_hf_to_gguf `permute` of Q or K rows: it stores each head's
    rotary halves interleaved (pairs), transformers keeps them as two halves.

        (H * D, C) -> (H, D/2, 2, C) -> swap -> (H, 2, D/2, C) -> (H * D, C)"""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_name(name: str, path: Path, arch: str = "llama") -> str:
    """transformers' name of a llama.cpp tensor name ('blk.3.attn_q.weight' ->
    'model.layers.3.self_attn.q_proj.weight'); a name it does not know is a CheckpointError."""
    stem, _, kind = name.rpartition(".")
    if stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    names = {**LAYER_NAMES, **LAYER_NAMES_OF.get(arch, {})}
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{kind}"
    raise CheckpointError(f"{path}: unexpected GGUF tensor {name!r}")


def dequantize(tensor, path: Path) -> torch.Tensor:
    """One GGUF tensor as float32 in its logical shape (rows, columns), by gguf.quants."""
    from gguf import quants

    kind = tensor.tensor_type.name
    if kind not in DEQUANTIZED:
        raise CheckpointError(f"{path}: tensor {tensor.name} is quantized as {kind}, which is not supported "
                              f"(supported: {', '.join(DEQUANTIZED)})")
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # ggml lists the fastest dimension first
    try:
        values = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        values = np.array(values, dtype=np.float32, copy=True).reshape(shape)  # owned, writable
    except (ValueError, IndexError) as e:
        raise CheckpointError(f"{path}: tensor {tensor.name} ({kind}, shape {list(shape)}) cannot be read: {e}") from e
    return torch.from_numpy(values)


def read_tensors(reader, config: dict[str, Any], path: Path, *, permuted: bool,
                 progress: Callable[[int, int], None] | None = None, arch: str = "llama",
                 ) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Every tensor, float32, under transformers' names; Q and K rows un-permuted when `permuted`;
    a Gemma's norms as transformers keeps them (w, where the file holds 1 + w)."""
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    out: dict[str, torch.Tensor] = {}
    formats: dict[str, int] = {}
    total = len(reader.tensors)
    for i, tensor in enumerate(reader.tensors):
        name = hf_name(tensor.name, path, arch)
        w = dequantize(tensor, path)
        if arch in GEMMAS and name.endswith("norm.weight"):
            w = w - 1
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            w = unpermute(w, n_heads if ".q_proj." in name else n_kv)
        out[name] = w
        formats[tensor.tensor_type.name] = formats.get(tensor.tensor_type.name, 0) + 1
        if progress is not None:
            progress(i + 1, total)
    return out, formats


PACKABLE = ("Q4_0", "Q4_1", "Q8_0")  # block formats model/packed/ multiplies with directly


def read_blocks(reader, config: dict[str, Any], path: Path, *, permuted: bool,
                arch: str = "llama") -> dict[str, tuple[torch.Tensor, str]]:
    """The 2-D tensors in a PACKABLE format as their raw blocks: (rows, row bytes) uint8 under
    transformers' names, Q and K rows un-permuted like the float32 ones (a row permutation moves
    whole rows of blocks)."""
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    out = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in PACKABLE or len(tensor.shape) != 2:
            continue
        name = hf_name(tensor.name, path, arch)
        rows = int(tensor.shape[1])  # ggml lists the fastest dimension first
        raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8, copy=True).reshape(rows, -1))
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            raw = unpermute(raw, n_heads if ".q_proj." in name else n_kv)
        out[name] = (raw, kind)
    return out