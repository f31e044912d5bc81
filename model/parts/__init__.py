"""The parts every model family is built from, each written once (one module per part).

Shapes: B = batch, T = query positions (new tokens in this call), S = key positions the
queries may see (cached + new, or the memory's length for cross-attention), C = d_model,
H = query heads, K = key/value heads, D = d_head, R = rotary dims, F = d_ff.

    embeddings   Embeddings          mixin: token embedding + learned or sinusoidal positions
                                     (or, for rotary positions, their angles), dropout
    positions    sinusoidal_table    fixed positions of Vaswani et al. (2017)
                 RotaryEmbedding     rotary angles (full or partial, base and scaling from the
                 apply_rotary        config: linear, llama3), applied to queries and keys
    attention    MultiHeadAttention  self- or cross-attention; multi-head, grouped-query or
                                     multi-query (n_kv_heads); an optional RMSNorm per head
                                     on queries and keys (qk_norm: Qwen3); a boolean mask broadcastable to
                                     (B, H, T, S), True = may attend, and/or `causal`; the SDPA
                                     fast path, or the explicit path that also returns the
                                     (B, H, T, S) probabilities, one map per query head
                 sliding_window_mask, InPlaceDecode (a cache layer that attends a decode step
                 where its keys lie)
    attention_backends               how attention is computed on a device, chosen once per
                 device (backend_for: CpuAttention, CudaAttention, TorchAttention); causal_mask,
                 sdpa, fixed_shapes
    causal_attention                 a causal prefill's attention on the CPU by our C kernel
                                     (model/native/causal_attention.c), SDPA's numbers faster
    feedforward  FeedForward         Linear(C -> F), act, Linear(F -> C); gated: SwiGLU / GeGLU
                 MixtureOfExperts    a router and top-k of E FeedForward experts (Mixtral)
                 activate            gelu (tanh) | gelu_exact | relu | silu
    norms        RMSNorm, make_norm  LayerNorm | RMSNorm
    block        Block, BlockOutput  residual sub-layers: pre-LN (GPT-2, Llama), post-LN
                                     (Vaswani, BERT) or parallel (GPT-NeoX); self-attention
                                     (causal or not), an optional cross-attention, the FFN

Hook points (model/hooks.py): Block and MultiHeadAttention own their HookPoints as submodules
(hook_resid_pre, attn.hook_z, ...) and, when a caller has entered `hooks.hooked` (a context
variable), pass their named intermediates through them: kept, and z's ablated heads edited before
the output projection. Unused, that is one context-variable read and a None check per module.

Which parts a model uses is its config's choice (model/config.py); a family (decoder:
model/families/decoder.py) chooses how to stack them; it never copies them.
"""

from attnlens.model.parts.attention import (
    InPlaceDecode,
    KVUpdate,
    MultiHeadAttention,
    sliding_window_mask,
)
from attnlens.model.parts.attention_backends import (
    CUDA_SDPA_BACKENDS,
    AttentionBackend,
    backend_for,
    causal_mask,
    fixed_shapes,
    sdpa,
)
from attnlens.model.parts.block import Block, BlockOutput
from attnlens.model.parts.embeddings import Embeddings
from attnlens.model.parts.feedforward import FeedForward, MixtureOfExperts, activate
from attnlens.model.parts.norms import RMSNorm, make_norm
from attnlens.model.parts.positions import (
    RotaryAngles,
    RotaryEmbedding,
    apply_rotary,
    rotary_inv_freq,
    rotate_half,
    sinusoidal_table,
)

__all__ = [
    "CUDA_SDPA_BACKENDS",
    "AttentionBackend",
    "Block",
    "BlockOutput",
    "Embeddings",
    "FeedForward",
    "MixtureOfExperts",
    "InPlaceDecode",
    "KVUpdate",
    "MultiHeadAttention",
    "RMSNorm",
    "RotaryAngles",
    "RotaryEmbedding",
    "activate",
    "apply_rotary",
    "backend_for",
    "causal_mask",
    "fixed_shapes",
    "make_norm",
    "rotary_inv_freq",
    "rotate_half",
    "sdpa",
    "sinusoidal_table",
    "sliding_window_mask",
]
