"""GGUF files of Gemma 2, Gemma 3 and Phi-3 as an import source: a small random transformers
model of each class written the way llama.cpp's converter writes it (its tensor names, Gemma's
norms as 1 + w, Phi-3's fused qkv and gate|up, the metadata llama.cpp reads: soft-caps, the
sliding window, rope scaling), imported, and checked against the transformers model it came
from (logits and every attention map, the F32 file) and against transformers' own GGUF loader
(every weight, Q8_0 too, and the Q8_0 blocks served packed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from arch_helpers import perturb_  # noqa: E402
from helpers import GGUF_CHATML, gguf_vocabulary  # noqa: E402

from attnlens.model import load_checkpoint  # noqa: E402
from attnlens.model.checkpoint import CheckpointError  # noqa: E402
from attnlens.model.interop.convert import import_checkpoint  # noqa: E402

COMMON = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
# arch -> (transformers config and model classes, config), each as llama.cpp reads such a file back:
# Gemma's scale is 1/sqrt(head_dim) (query_pre_attn_scalar = head_dim), Gemma 2 sliding from layer
# 0 in turn, Gemma 3 five sliding to one full with base 10000 on them
MODELS = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(hidden_size=48, intermediate_size=96, head_dim=16, query_pre_attn_scalar=16, num_hidden_layers=3,
                    sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(hidden_size=48, intermediate_size=96, head_dim=16, query_pre_attn_scalar=16, num_hidden_layers=6,
                    sliding_window=8,
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                        "rope_theta": 1000000.0}})),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, sliding_window=8,
                  tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
}
# transformers' names -> llama.cpp's (per layer: model.layers.{i}.<name> -> blk.{i}.<name>)
GGUF_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
GGUF_LAYER_OF = {
    "gemma": {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
              "post_feedforward_layernorm": "post_ffw_norm"},
    "phi3": {"post_attention_layernorm": "ffn_norm"},
}


def gguf_name(name: str, arch: str) -> str:
    if name.startswith("model.layers."):
        _, _, i, rest = name.split(".", 3)
        stem, kind = rest.rsplit(".", 1)
        names = {**GGUF_LAYER, **GGUF_LAYER_OF["gemma" if arch.startswith("gemma") else arch]}
        return f"blk.{i}.{names[stem]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[name]


def write_model_gguf(arch: str, path, qtype: str, *, seed: int = 0, spm=None):
    """The random transformers model of `arch` (its vocabulary gguf_vocabulary's, or the SentencePiece
    one `spm`, a spm_helpers.SpmVocab) and a GGUF file of it."""
    tokens, merges, types = gguf_vocabulary() if spm is None else (spm.tokens, [], spm.types)
    config_class, model_class, extra = MODELS[arch]
    config = getattr(transformers, config_class)(vocab_size=len(tokens), **{**COMMON, **extra}, pad_token_id=None,
                                                 bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    perturb_(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(64)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(len(tokens))
    w.add_sliding_window(config.sliding_window)
    if arch.startswith("gemma"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_dimension_count(head_dim)
        if arch == "gemma2":
            w.add_rope_freq_base(10000.0)
            w.add_attn_logit_softcapping(config.attn_logit_softcapping)
            w.add_final_logit_softcapping(config.final_logit_softcapping)
        else:
            w.add_rope_freq_base(1000000.0)
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(4.0)
    else:
        w.add_rope_freq_base(10000.0)
        w.add_rope_dimension_count(head_dim // 2)
    if spm is not None:
        spm.write(w)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)
        w.add_chat_template(GGUF_CHATML)
    w.add_pad_token_id(0)  # transformers' Phi3Config would say 32000, past this vocabulary
    qt = gguf.GGMLQuantizationType[qtype]
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        values = t.detach().float().numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            values = values + 1  # llama.cpp's Gemma converter stores 1 + w
        if values.ndim == 1 or qt == gguf.GGMLQuantizationType.F32 or values.shape[-1] % 32:  # rows of whole blocks
            w.add_tensor(gguf_name(name, arch), values.astype(np.float32))
        else:
            w.add_tensor(gguf_name(name, arch), gguf.quants.quantize(values.astype(np.float32), qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


@pytest.mark.parametrize("arch", list(MODELS))
def test_an_f32_file_computes_as_the_model_it_came_from(arch, tmp_path):
    hf = write_model_gguf(arch, tmp_path / "model.gguf", "F32")
    out, architecture = import_checkpoint(tmp_path / "model.gguf", tmp_path / "ckpt")
    ckpt = load_checkpoint(out)
    assert ckpt.config.architecture == architecture.hf_class == type(hf).__name__
    ids = torch.randint(0, ckpt.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, ours = hf(ids, output_attentions=True), ckpt.model(ids, return_attention=True)
    torch.testing.assert_close(ours.logits, ref.logits, atol=1e-4, rtol=0)
    for a, b in zip(ours.attentions, ref.attentions):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", list(MODELS))
def test_every_weight_equals_transformers_gguf_loader(arch, tmp_path):
    """A Q8_0 file's weights (F32 where a row is not whole blocks) as transformers' own GGUF loader
    reads them (its names, its 1 + w)."""
    write_model_gguf(arch, tmp_path / "model.gguf", "Q8_0", seed=3)
    out, _ = import_checkpoint(tmp_path / "model.gguf", tmp_path / "ckpt")
    ckpt = load_checkpoint(out)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="model.gguf", dtype=torch.float32)
    from test_gguf import theirs_from_ours

    mine, want = theirs_from_ours(ckpt), {k: v.float() for k, v in theirs.state_dict().items()}
    if ckpt.config.tie_embeddings:
        want.pop("lm_head.weight", None)
    assert set(mine) == set(want)
    for name, t in mine.items():
        torch.testing.assert_close(t, want[name], atol=1e-6, rtol=0, msg=name)
    packed = load_checkpoint(out, packed=True)  # the Q8_0 matrices served in their blocks: the same logits
    assert any("Packed" in type(m).__name__ for m in packed.model.modules())
    ids = torch.tensor([[5, 40, 71, 100, 7, 26, 9, 10, 11, 12, 13, 14]])
    with torch.no_grad():
        torch.testing.assert_close(packed.model(ids).logits, ckpt.model(ids).logits, atol=1e-4, rtol=0)


def test_longrope_factors_are_refused_by_name(tmp_path):
    write_model_gguf("phi3", tmp_path / "model.gguf", "F32")
    reader = gguf.GGUFReader(str(tmp_path / "model.gguf"))
    w = gguf.GGUFWriter(str(tmp_path / "long.gguf"), arch="phi3")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        kind = field.types[0] if field.types else None
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data, dtype=np.float32).reshape([int(n) for n in reversed(t.shape.tolist())]))
    w.add_tensor("rope_factors_long.weight", np.ones(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="rope_factors_long / rope_factors_short \\(LongRoPE"):
        import_checkpoint(tmp_path / "long.gguf", tmp_path / "out")
