"""Hugging Face BERT interop: write a BERT-shaped encoder as `transformers` BertForMaskedLM,
and read a BertForMaskedLM directory already on disk into an attnlens encoder checkpoint.

Names map one to one (ours -> BertForMaskedLM), with our fused q/k/v split in three::

    tok_emb                 -> bert.embeddings.word_embeddings
    pos_emb                 -> bert.embeddings.position_embeddings
    (zeros)                 -> bert.embeddings.token_type_embeddings  (row 0 folded into positions on import)
    emb_norm                -> bert.embeddings.LayerNorm
    blocks.i.attn.qkv       -> bert.encoder.layer.i.attention.self.{query,key,value}
    blocks.i.attn.proj      -> bert.encoder.layer.i.attention.output.dense
    blocks.i.ln1            -> bert.encoder.layer.i.attention.output.LayerNorm
    blocks.i.ffn.fc         -> bert.encoder.layer.i.intermediate.dense
    blocks.i.ffn.proj       -> bert.encoder.layer.i.output.dense
    blocks.i.ln2            -> bert.encoder.layer.i.output.LayerNorm
    mlm_dense, mlm_norm     -> cls.predictions.transform.{dense,LayerNorm}
    mlm_bias                -> cls.predictions.bias (the decoder is tied to word_embeddings)

Our classification head (pooler + classifier on a mean- or [CLS]-pooled state) is not part
of BertForMaskedLM and is not exported. Like model/interop/hf.py, this module does not import
`transformers`: both directions only read and write files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from attnlens.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from attnlens.model.config import ConfigError, ModelConfig
from attnlens.model.families.encoder import Encoder
from attnlens.model.interop.hf import read_hf_config, read_hf_weights, write_hf_dir, write_json
from attnlens.model.tokenizer import CLS_TOKEN, MASK_TOKEN, PAD_TOKEN, SEP_TOKEN, Tokenizer

# BERT's hidden_act values and ours
ACTIVATIONS_TO_HF = {"relu": "relu", "gelu": "gelu_new", "gelu_exact": "gelu"}
ACTIVATIONS_FROM_HF = {"relu": "relu", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_exact"}

_LAYER = "bert.encoder.layer.{i}."
_PER_LAYER = [  # (ours, BERT) for tensors that copy as they are
    ("attn.proj", "attention.output.dense"),
    ("ln1", "attention.output.LayerNorm"),
    ("ffn.fc", "intermediate.dense"),
    ("ffn.proj", "output.dense"),
    ("ln2", "output.LayerNorm"),
]
_GLOBAL = [
    ("tok_emb.weight", "bert.embeddings.word_embeddings.weight"),
    ("pos_emb.weight", "bert.embeddings.position_embeddings.weight"),
    ("emb_norm.weight", "bert.embeddings.LayerNorm.weight"),
    ("emb_norm.bias", "bert.embeddings.LayerNorm.bias"),
]
_MLM_HEAD = [  # BertForMaskedLM's; a BertModel (e.g. a sentence-transformers model) has none
    ("mlm_dense.weight", "cls.predictions.transform.dense.weight"),
    ("mlm_dense.bias", "cls.predictions.transform.dense.bias"),
    ("mlm_norm.weight", "cls.predictions.transform.LayerNorm.weight"),
    ("mlm_norm.bias", "cls.predictions.transform.LayerNorm.bias"),
    ("mlm_bias", "cls.predictions.bias"),
]


def name_pairs(n_layers: int, mlm_head: bool = True) -> list[tuple[str, str]]:
    """(our name, BERT name) for every tensor that copies unchanged."""
    pairs = _GLOBAL + (_MLM_HEAD if mlm_head else [])
    for i in range(n_layers):
        for ours, theirs in _PER_LAYER:
            for suffix in ("weight", "bias"):
                pairs.append((f"blocks.{i}.{ours}.{suffix}", _LAYER.format(i=i) + f"{theirs}.{suffix}"))
    return pairs


# --- export ------------------------------------------------------------------------------
def bert_config_dict(config: ModelConfig, tokenizer: Tokenizer | None) -> dict[str, Any]:
    pad = tokenizer.pad_id if tokenizer is not None else None
    return {
        "architectures": ["BertForMaskedLM"],
        "model_type": "bert",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "intermediate_size": config.d_ff,
        "hidden_act": ACTIVATIONS_TO_HF[config.activation],
        "hidden_dropout_prob": config.dropout,
        "attention_probs_dropout_prob": config.dropout,
        "max_position_embeddings": config.context_length,
        "type_vocab_size": 2,
        "layer_norm_eps": config.layer_norm_eps,
        "initializer_range": 0.02,
        "position_embedding_type": "absolute",
        "pad_token_id": pad if pad is not None else 0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }


def bert_state(model: Encoder) -> dict[str, torch.Tensor]:
    ours = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    C = model.config.d_model
    state = {theirs: ours[mine].contiguous() for mine, theirs in name_pairs(model.config.n_layers)}
    state["bert.embeddings.token_type_embeddings.weight"] = torch.zeros(2, C)
    state["cls.predictions.decoder.bias"] = ours["mlm_bias"].clone()
    for i in range(model.config.n_layers):
        w = ours[f"blocks.{i}.attn.qkv.weight"]  # (3C, C): rows q, k, v
        b = ours[f"blocks.{i}.attn.qkv.bias"]
        for j, part in enumerate(("query", "key", "value")):
            prefix = _LAYER.format(i=i) + f"attention.self.{part}."
            state[prefix + "weight"] = w[j * C : (j + 1) * C].contiguous()
            state[prefix + "bias"] = b[j * C : (j + 1) * C].contiguous()
    return state


def export_bert(model_dir: str | Path, out_dir: str | Path) -> Path:
    """Write the encoder checkpoint in `model_dir` as a transformers BertForMaskedLM directory."""
    ckpt = load_checkpoint(model_dir)
    reasons = ckpt.config.is_bert_shaped()
    if reasons:
        raise ValueError(f"{model_dir}: cannot export as BERT: " + "; ".join(reasons))
    tok = ckpt.tokenizer
    out = write_hf_dir(out_dir, bert_state(ckpt.model), bert_config_dict(ckpt.config, tok), tok)
    special = {"pad_token": PAD_TOKEN, "cls_token": CLS_TOKEN, "sep_token": SEP_TOKEN,
               "mask_token": MASK_TOKEN, "unk_token": PAD_TOKEN}
    write_json(out / "special_tokens_map.json", special)
    write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": ckpt.config.context_length,
        "clean_up_tokenization_spaces": False,
        **special,
    })
    return out




# --- import ------------------------------------------------------------------------------
def config_from_bert(data: dict[str, Any], path: Path) -> ModelConfig:
    if data.get("model_type", "bert") != "bert":
        raise CheckpointError(f"{path}: model_type is {data.get('model_type')!r}, only 'bert' can be imported")
    reasons = []
    act = data.get("hidden_act", "gelu")
    if act not in ACTIVATIONS_FROM_HF:
        reasons.append(f"hidden_act {act!r} is not one of {sorted(ACTIVATIONS_FROM_HF)}")
    if data.get("position_embedding_type", "absolute") != "absolute":
        reasons.append("only absolute position embeddings are supported")
    if data.get("is_decoder") or data.get("add_cross_attention"):
        reasons.append("a BERT used as a decoder is not supported")
    if not data.get("tie_word_embeddings", True):
        reasons.append("tie_word_embeddings=false is not supported")
    if reasons:
        raise CheckpointError(f"{path}: cannot import this BERT: " + "; ".join(reasons))
    try:
        return ModelConfig(
            family="encoder",
            vocab_size=data["vocab_size"],
            context_length=data.get("max_position_embeddings", 512),
            d_model=data["hidden_size"],
            n_layers=data["num_hidden_layers"],
            n_heads=data["num_attention_heads"],
            d_ff=data["intermediate_size"],
            dropout=float(data.get("hidden_dropout_prob", 0.0)),
            positional="learned",
            norm="post",
            activation=ACTIVATIONS_FROM_HF[act],
            layer_norm_eps=float(data.get("layer_norm_eps", 1e-12)),
        )
    except KeyError as e:
        raise CheckpointError(f"{path}: missing field {e.args[0]!r}") from e
    except (ConfigError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: invalid BERT config ({e})") from e


def has_mlm_head(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether the weights hold BertForMaskedLM's head (a BertModel's do not)."""
    return any(k.startswith("cls.predictions.") for k in tensors)


def state_from_bert(tensors: dict[str, torch.Tensor], config: ModelConfig, path: Path) -> dict[str, torch.Tensor]:
    """Our tensors from BERT's; without a masked-LM head (config.mlm_head False) its tensors are
    left out, for the model's own initialisation."""
    # some checkpoints store names without the "bert." prefix
    t = {(k if k.startswith(("bert.", "cls.")) else "bert." + k): v for k, v in tensors.items()}
    pairs = name_pairs(config.n_layers, config.mlm_head)
    need = [theirs for _, theirs in pairs]
    need.append("bert.embeddings.token_type_embeddings.weight")
    for i in range(config.n_layers):
        for part in ("query", "key", "value"):
            for suffix in ("weight", "bias"):
                need.append(_LAYER.format(i=i) + f"attention.self.{part}.{suffix}")
    missing = [n for n in need if n not in t]
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) {', '.join(missing[:8])}")
    state = {mine: t[theirs].float() for mine, theirs in pairs}
    # every input here has token_type 0: its embedding row is a constant added to each position
    state["pos_emb.weight"] = state["pos_emb.weight"] + t["bert.embeddings.token_type_embeddings.weight"][0].float()
    for i in range(config.n_layers):
        pre = _LAYER.format(i=i) + "attention.self."
        state[f"blocks.{i}.attn.qkv.weight"] = torch.cat([t[pre + f"{p}.weight"].float() for p in ("query", "key", "value")])
        state[f"blocks.{i}.attn.qkv.bias"] = torch.cat([t[pre + f"{p}.bias"].float() for p in ("query", "key", "value")])
    return state


def read_bert_tokenizer(src: Path) -> Tokenizer:
    """tokenizer.json if present, else BERT's vocab.txt (WordPiece, lower-cased as in tokenizer_config)."""
    tok_json, vocab = src / "tokenizer.json", src / "vocab.txt"
    try:
        if tok_json.is_file():
            return Tokenizer.from_file(tok_json)
        if vocab.is_file():
            from tokenizers import BertWordPieceTokenizer

            lower = True
            cfg = src / "tokenizer_config.json"
            if cfg.is_file():
                lower = bool(json.loads(cfg.read_text(encoding="utf-8")).get("do_lower_case", True))
            return Tokenizer(BertWordPieceTokenizer(str(vocab), lowercase=lower)._tokenizer)
    except Exception as e:  # the tokenizers library raises plain Exceptions
        raise CheckpointError(f"{tok_json if tok_json.is_file() else vocab}: cannot be read as a tokenizer ({e})") from e
    raise CheckpointError(f"{src}: no tokenizer found (need tokenizer.json or vocab.txt)")


def import_bert(src_dir: str | Path, out_dir: str | Path) -> Path:
    """Convert the BertForMaskedLM (or BertModel) directory `src_dir` into an attnlens encoder
    checkpoint. A BertModel has no masked-LM head: the checkpoint then says so (config.mlm_head
    False) and its head keeps the model's initialisation until one is trained."""
    src = Path(src_dir)
    data, config_path = read_hf_config(src)
    config = config_from_bert(data, config_path)
    tensors, weights_path = read_hf_weights(src)  # the same file layouts as any HF model
    config.mlm_head = has_mlm_head(tensors)
    state = state_from_bert(tensors, config, weights_path)
    tokenizer = read_bert_tokenizer(src)
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(f"{src}: tokenizer has {tokenizer.vocab_size} tokens but config.json "
                              f"says vocab_size={config.vocab_size}")
    model = Encoder(config)
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a shape that config.json does not imply
        raise CheckpointError(f"{weights_path}: tensors do not match config.json ({e})") from e
    untrained = {mine for mine, _ in _MLM_HEAD} if not config.mlm_head else set()
    if result.unexpected_keys or set(result.missing_keys) - untrained:
        raise CheckpointError(f"{weights_path}: tensors do not match config.json ({result})")
    save_checkpoint(out_dir, model, tokenizer)
    return Path(out_dir)
