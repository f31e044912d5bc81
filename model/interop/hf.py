"""Hugging Face GPT-2 interop: write our checkpoints as `transformers` GPT-2, read GPT-2 back.

`export_hf` writes a directory that ``transformers.GPT2LMHeadModel.from_pretrained`` and
``transformers.PreTrainedTokenizerFast(tokenizer_file=.../tokenizer.json)`` load.
`import_hf` converts a GPT-2 directory already on disk (nothing is downloaded) into an
attnlens checkpoint the service can serve.

Module names map one to one (ours -> GPT-2)::

    tok_emb                -> wte
    pos_emb                -> wpe
    blocks.i.ln1           -> h.i.ln_1
    blocks.i.attn.qkv      -> h.i.attn.c_attn   (Conv1D: weight stored transposed)
    blocks.i.attn.proj     -> h.i.attn.c_proj   (Conv1D)
    blocks.i.ln2           -> h.i.ln_2
    blocks.i.ffn.fc        -> h.i.mlp.c_fc      (Conv1D)
    blocks.i.ffn.proj      -> h.i.mlp.c_proj    (Conv1D)
    ln_f                   -> ln_f
    lm_head                -> tied to wte

This module does not import `transformers`: both directions only read and write files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from attnlens.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from attnlens.model.config import ConfigError, ModelConfig
from attnlens.model.families.decoder import Transformer
from attnlens.model.tokenizer import Tokenizer

HF_PREFIX = "transformer."
# GPT-2 activations that are exactly our tanh-approximated GELU.
TANH_GELU_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
# Buffers old GPT-2 checkpoints carry (the causal mask and its fill value): not weights.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".crossattention.bias", ".crossattention.masked_bias")

# (our name pattern, GPT-2 name pattern, Conv1D-transposed?) for per-layer tensors.
_LAYER_MAP = [
    ("ln1.weight", "ln_1.weight", False),
    ("ln1.bias", "ln_1.bias", False),
    ("attn.qkv.weight", "attn.c_attn.weight", True),
    ("attn.qkv.bias", "attn.c_attn.bias", False),
    ("attn.proj.weight", "attn.c_proj.weight", True),
    ("attn.proj.bias", "attn.c_proj.bias", False),
    ("ln2.weight", "ln_2.weight", False),
    ("ln2.bias", "ln_2.bias", False),
    ("ffn.fc.weight", "mlp.c_fc.weight", True),
    ("ffn.fc.bias", "mlp.c_fc.bias", False),
    ("ffn.proj.weight", "mlp.c_proj.weight", True),
    ("ffn.proj.bias", "mlp.c_proj.bias", False),
]
_GLOBAL_MAP = [
    ("tok_emb.weight", "wte.weight"),
    ("pos_emb.weight", "wpe.weight"),
    ("ln_f.weight", "ln_f.weight"),
    ("ln_f.bias", "ln_f.bias"),
]


def name_map(n_layers: int) -> dict[str, tuple[str, bool]]:
    """Our tensor name -> (bare GPT-2 name, transposed?) for a GPT-2-shaped model."""
    mapping = {ours: (theirs, False) for ours, theirs in _GLOBAL_MAP}
    for i in range(n_layers):
        for ours, theirs, transposed in _LAYER_MAP:
            mapping[f"blocks.{i}.{ours}"] = (f"h.{i}.{theirs}", transposed)
    return mapping


# --- export ------------------------------------------------------------------------------


def gpt2_config_dict(config: ModelConfig, tokenizer: Tokenizer | None) -> dict[str, Any]:
    """A transformers GPT2Config (as config.json) describing `config` (bos/eos: the tokenizer's EOS)."""
    eos = tokenizer.eos_id if tokenizer is not None else None
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.context_length,
        "n_ctx": config.context_length,
        "n_embd": config.d_model,
        "n_layer": config.n_layers,
        "n_head": config.n_heads,
        "n_inner": config.d_ff,
        "activation_function": "gelu_new",
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "layer_norm_epsilon": config.layer_norm_eps,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }


def gpt2_state(model: Transformer) -> dict[str, torch.Tensor]:
    """Our weights under transformers' GPT2LMHeadModel names, Conv1D weights transposed.

    The tied LM head is left out: GPT2LMHeadModel ties it to transformer.wte on load.
    """
    ours = model.state_dict()
    state = {}
    for our_name, (hf_name, transposed) in name_map(model.config.n_layers).items():
        t = ours[our_name].detach().float().cpu()
        state[HF_PREFIX + hf_name] = (t.t() if transposed else t).contiguous()
    return state


def export_hf(model_dir: str | Path, out_dir: str | Path) -> Path:
    """Write the checkpoint in `model_dir` as a transformers GPT-2 directory; return it.

    Raises ValueError (naming every reason) for a config GPT-2 cannot express.
    """
    ckpt = load_checkpoint(model_dir)
    reasons = ckpt.config.is_gpt2_shaped()
    if reasons:
        raise ValueError(f"{model_dir}: cannot export as GPT-2: " + "; ".join(reasons))
    tok = ckpt.tokenizer
    out = write_hf_dir(out_dir, gpt2_state(ckpt.model), gpt2_config_dict(ckpt.config, tok), tok)

    for name, data in tok.transformers_files(ckpt.config.context_length).items():
        write_json(out / name, data)
    if tok.eos_id is not None:
        write_json(
            out / "generation_config.json",
            {"bos_token_id": tok.eos_id, "eos_token_id": tok.eos_id},
        )
    return out


def write_hf_dir(out_dir: str | Path, state: dict[str, torch.Tensor], config: dict[str, Any],
                 tokenizer: Tokenizer) -> Path:
    """Start a transformers directory: model.safetensors (written atomically), config.json
    and tokenizer.json; return it. The caller adds its family's tokenizer files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt", "producer": "attnlens"})
    tmp.replace(out / "model.safetensors")
    write_json(out / "config.json", config)
    tokenizer.save(out / "tokenizer.json")
    return out


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


# --- import ------------------------------------------------------------------------------


def config_from_gpt2(data: dict[str, Any], path: Path) -> ModelConfig:
    """Our ModelConfig for a transformers GPT-2 config.json (refusing what we cannot run)."""

    def need(key: str, *fallbacks: str) -> Any:
        for k in (key, *fallbacks):
            if data.get(k) is not None:
                return data[k]
        raise CheckpointError(f"{path}: missing field {key!r}")

    model_type = data.get("model_type")
    if model_type is not None and model_type != "gpt2":
        raise CheckpointError(f"{path}: model_type is {model_type!r}, only 'gpt2' can be imported")
    reasons = []
    activation = data.get("activation_function", "gelu_new")
    if activation not in TANH_GELU_ACTIVATIONS:
        reasons.append(
            f"activation_function {activation!r} is not a tanh-GELU ({', '.join(TANH_GELU_ACTIVATIONS)})"
        )
    if not data.get("scale_attn_weights", True):
        reasons.append("scale_attn_weights=false (unscaled attention) is not supported")
    if data.get("scale_attn_by_inverse_layer_idx", False):
        reasons.append("scale_attn_by_inverse_layer_idx=true is not supported")
    if data.get("add_cross_attention", False):
        reasons.append("add_cross_attention=true (an encoder-decoder GPT-2) is not supported")
    if not data.get("tie_word_embeddings", True):
        reasons.append("tie_word_embeddings=false (an untied LM head) is not supported")
    if reasons:
        raise CheckpointError(f"{path}: cannot import this GPT-2: " + "; ".join(reasons))

    d_model = need("n_embd", "hidden_size")
    n_inner = data.get("n_inner")
    try:
        return ModelConfig(
            vocab_size=need("vocab_size"),
            context_length=need("n_positions", "n_ctx", "max_position_embeddings"),
            d_model=d_model,
            n_layers=need("n_layer", "num_hidden_layers"),
            n_heads=need("n_head", "num_attention_heads"),
            d_ff=4 * d_model if n_inner is None else n_inner,
            dropout=float(data.get("resid_pdrop", 0.0)),
            positional="learned",
            norm="pre",
            activation="gelu",
            bias=True,
            tie_embeddings=True,
            scale_embeddings=False,
            layer_norm_eps=float(data.get("layer_norm_epsilon", 1e-5)),
        )
    except (ConfigError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: invalid GPT-2 config ({e})") from e


def read_hf_weights(src: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """All tensors of a transformers directory (model.safetensors, a sharded index, or
    pytorch_model.bin, read without unpickling anything but tensors) and the file they came from."""
    single = src / "model.safetensors"
    index = src / "model.safetensors.index.json"
    pickle = src / "pytorch_model.bin"
    if single.is_file():
        return _read_safetensors(single), single
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        tensors = {}
        for shard in shards:
            shard_path = src / shard
            if not shard_path.is_file():
                raise CheckpointError(f"{shard_path}: file is missing (listed in {index.name})")
            tensors.update(_read_safetensors(shard_path))
        return tensors, index
    if pickle.is_file():
        try:
            state = torch.load(str(pickle), map_location="cpu", weights_only=True)
        except Exception as e:  # truncated zip, pickle refused by weights_only, ...
            raise CheckpointError(f"{pickle}: cannot be read as a PyTorch state dict ({e})") from e
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CheckpointError(f"{pickle}: does not hold a flat dict of tensors")
        return dict(state), pickle
    raise CheckpointError(f"{src}: no weights found (need model.safetensors or pytorch_model.bin)")


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:
        raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({e})") from e


def state_from_gpt2(
    tensors: dict[str, torch.Tensor], config: ModelConfig, path: Path
) -> dict[str, torch.Tensor]:
    """Our state dict from GPT-2 tensors under either "transformer.h.0..." or bare "h.0..." names."""
    bare: dict[str, torch.Tensor] = {}
    lm_head = None
    for name, t in tensors.items():
        if name.endswith(IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight":
            lm_head = t
            continue
        key = name[len(HF_PREFIX):] if name.startswith(HF_PREFIX) else name
        bare[key] = t

    mapping = name_map(config.n_layers)
    wanted = {theirs for theirs, _ in mapping.values()}
    missing = sorted(wanted - set(bare), key=_natural)
    unexpected = sorted(set(bare) - wanted, key=_natural)
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) {', '.join(missing[:8])}")
    if unexpected:
        raise CheckpointError(f"{path}: unexpected tensor(s) {', '.join(unexpected[:8])}")
    if lm_head is not None and not torch.equal(lm_head, bare["wte.weight"]):
        raise CheckpointError(f"{path}: lm_head.weight differs from wte.weight; only a tied head is supported")

    shapes = _expected_shapes(config)
    state = {}
    for ours, (theirs, transposed) in mapping.items():
        t = bare[theirs]
        t = t.t() if transposed and t.dim() == 2 else t
        if tuple(t.shape) != shapes[ours]:
            got = list(bare[theirs].shape)
            raise CheckpointError(
                f"{path}: tensor {theirs} has shape {got} but config.json implies "
                f"{list(shapes[ours][::-1]) if transposed else list(shapes[ours])}"
            )
        state[ours] = t.contiguous()
    return state


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    C, F, V, P = config.d_model, config.d_ff, config.vocab_size, config.context_length
    shapes = {"tok_emb.weight": (V, C), "pos_emb.weight": (P, C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    per_layer = {
        "ln1.weight": (C,), "ln1.bias": (C,),
        "attn.qkv.weight": (3 * C, C), "attn.qkv.bias": (3 * C,),
        "attn.proj.weight": (C, C), "attn.proj.bias": (C,),
        "ln2.weight": (C,), "ln2.bias": (C,),
        "ffn.fc.weight": (F, C), "ffn.fc.bias": (F,),
        "ffn.proj.weight": (C, F), "ffn.proj.bias": (C,),
    }  # fmt: skip
    for i in range(config.n_layers):
        for name, shape in per_layer.items():
            shapes[f"blocks.{i}.{name}"] = shape
    return shapes


def _natural(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def read_gpt2_tokenizer(src: Path) -> Tokenizer:
    """tokenizer.json if present, else GPT-2's original vocab.json + merges.txt."""
    tok_json = src / "tokenizer.json"
    vocab, merges = src / "vocab.json", src / "merges.txt"
    try:
        if tok_json.is_file():
            return Tokenizer.from_file(tok_json)
        if vocab.is_file() and merges.is_file():
            return Tokenizer.from_vocab_merges(vocab, merges)
    except Exception as e:  # the tokenizers library raises plain Exceptions
        bad = tok_json if tok_json.is_file() else vocab
        raise CheckpointError(f"{bad}: cannot be read as a tokenizer ({e})") from e
    raise CheckpointError(f"{src}: no tokenizer found (need tokenizer.json or vocab.json + merges.txt)")


def read_hf_config(src: Path) -> tuple[dict[str, Any], Path]:
    """The JSON object in a transformers directory's config.json, and that file's path
    (every problem a CheckpointError naming the file)."""
    if not src.is_dir():
        raise CheckpointError(f"{src}: directory does not exist")
    config_path = src / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: file is missing")
    try:
        data = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{config_path}: expected a JSON object")
    return data, config_path


def import_hf(src_dir: str | Path, out_dir: str | Path) -> Path:
    """Convert the transformers GPT-2 directory `src_dir` into an attnlens checkpoint; return it."""
    src = Path(src_dir)
    data, config_path = read_hf_config(src)
    config = config_from_gpt2(data, config_path)

    tensors, weights_path = read_hf_weights(src)
    state = state_from_gpt2(tensors, config, weights_path)
    tokenizer = read_gpt2_tokenizer(src)
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"{src}: tokenizer has {tokenizer.vocab_size} tokens but config.json says "
            f"vocab_size={config.vocab_size}"
        )

    model = Transformer(config)
    result = model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}, result
    # Keep a half-precision source in half precision (GPT-2 XL in fp32 is 6 GB).
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    keep = dtypes.pop() if len(dtypes) == 1 else None
    save_checkpoint(out_dir, model, tokenizer, dtype=keep if keep in (torch.float16, torch.bfloat16) else None)
    return Path(out_dir)
