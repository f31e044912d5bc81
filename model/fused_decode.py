"""A decode step through every block in one C call (model/native/decode_layers.c), where it can be.

The modular path (model/parts/block.py and what it calls) runs about 40 torch operators a layer
for each decode step: norms, products, views, the rotary angles' multiplies and rolls, the cache's
indexed copies, the residual sums. With SmolLM2's small matrices that is ~1,280 operators a token
at a few µs each, a third of a packed token's time (bench/README.md, issue 34). Here the whole
stack of blocks is one call: the same operations in the same order, by the same C kernels the
modular path uses for its products, norms and attention (float32 or packed weights).

It runs only where it computes exactly what the modular path would (`FusedDecode.build` checks
the model once; `fused_step` checks the call):
    the model  pre-norm blocks with RMSNorm, self-attention only, a SwiGLU feed-forward, no
               parallel residual; weights float32 (Linear) or packed (PackedLinear) on the CPU;
               optional q/k norm (Qwen3), biases, rotary positions (partial or whole); of the
               newer parts (ModelConfig.special_parts) only a scores' scale of its own
    the call   a decode step (one new token a row) over a KV cache in blocks, float32, at most
               MAX_ROWS rows, the rows' own mask (no sliding window narrowing it), no hooks
               (model/hooks.py), no autograd, not training, and the C kernels built here
Everything else, hooks and every explanation included, takes the modular path, which the tests
hold this one equal to (tests/model/test_fused_decode.py). Attention maps (return_attention) come
from the same kernel either way.

The description of a model's weights is built on its first fused step and rebuilt when their
storage moves (`model.to()`, `.float()`); values changed in place (`load_state_dict`, `copy_`)
are read as they are. A module whose weight is replaced by another Parameter object afterwards
needs `forget(model)`.

    fused_step(model, write, mask)  the model's FusedDecode when this call can take it, else None
    forget(model)                   drop the model's description (rebuilt on its next step)
    FusedDecode.run(x, rope, write, want_probs) -> (x after the last block, maps or None)
    modular_decode()                a context in which no step is fused (tests, benchmarks)
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Any

import torch
import torch.nn as nn

from attnlens.model import hooks as _hooks
from attnlens.model.native import library as native
from attnlens.model.parts.norms import RMSNorm
from attnlens.model.parts.positions import RotaryAngles, signed

# of the newer parts (ModelConfig.special_parts), the ones a fused step computes: the scale (it reads
# attn.scale) and those outside the blocks (the embedding's multiplier, the logits' divisor and cap:
# the modular code's before and after it); a model with any other (attention soft-caps, per-layer
# windows or rotary bases, post-norms, residual multipliers, ...) takes the modular path
FUSED_PARTS = {"attn_scale", "embedding_multiplier", "logits_divisor", "final_softcap", "lm_head_bias"}
MAX_ROWS = 64  # the packed kernel's rows (model/packed/modules.py's MAX_KERNEL_ROWS): the engine's most streams
_enabled = contextvars.ContextVar("attnlens_fused_decode", default=True)


@contextlib.contextmanager
def modular_decode():
    """Within this block every decode step takes the modular path (model/parts/block.py)."""
    token = _enabled.set(False)
    try:
        yield
    finally:
        _enabled.reset(token)


def _float32_cpu(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def _linear_weights(module: Any) -> tuple[torch.Tensor, int] | None:
    """(the weight as the kernel reads it, its format code: -1 float32) or None when not fusable."""
    from attnlens.model.packed import kernel
    from attnlens.model.packed.modules import PackedLinear

    if isinstance(module, PackedLinear):
        return module.packed.data, kernel.FORMATS[module.packed.fmt]  # the tensor its `blocks` buffer is
    if isinstance(module, nn.Linear) and _float32_cpu(module.weight):
        return module.weight, -1
    return None


class FusedDecode:
    """The C call's description of a model's blocks: one fused_layer per block
    (model/native/attnlens_kernels.h), built once."""

    def __init__(self, model: Any, layers: list[dict], tensors: list[torch.Tensor], eps: float, scale: float):
        c = model.config
        self.H: int = c.n_heads
        self.K: int = c.kv_heads
        self.D: int = c.d_head
        self.C: int = c.d_model
        self.F: int = c.d_ff
        self.R: int = c.rotary_dims if getattr(model, "rotary", None) is not None else 0
        self.eps, self.scale = eps, scale
        ffi = native.load().ffi
        self.layers = ffi.new("fused_layer[]", layers)
        self.address = int(ffi.cast("intptr_t", self.layers))  # decode_layers' `layers`
        # Each step points every layer at its cache's planes by writing addresses into the array seen
        # as pointer-sized words: as cheap as ctypes' fields were (a cast per field costs 3x: ~15 µs a
        # step at 30 layers). The offsets are the header's, from cffi.
        word, size = ffi.sizeof("intptr_t"), ffi.sizeof("fused_layer")
        self.words = ffi.cast("intptr_t *", self.layers)
        self.fields = [tuple((i * size + ffi.offsetof("fused_layer", f)) // word for f in ("keys", "values", "probs"))
                       for i in range(len(layers))]
        self.tensors = tensors  # held: their memory is what the pointers name
        self.pointers = [t.data_ptr() for t in tensors]
        self.lock = threading.Lock()  # each call points the layers at its own cache: one call at a time

    @classmethod
    def build(cls, model: Any) -> "FusedDecode | None":
        """The model's description, or None when its blocks are not the ones the C step computes."""
        c = model.config
        if c.norm != "pre" or c.parallel_residual or c.ffn != "gated" or c.activation != "silu" \
                or c.norm_type != "rmsnorm":
            return None
        if set(c.special_parts()) - FUSED_PARTS:  # Gemma's and later parts: the C step computes none of them
            return None
        layers: list[dict[str, Any]] = []
        cast = native.load().ffi.cast  # a pointer field's value: cast("void *", address), 0 for NULL
        tensors: list[torch.Tensor] = []
        eps: set[float] = set()
        scale: set[float] = set()

        def linear(module: nn.Module) -> dict[str, Any] | None:
            found = _linear_weights(module)
            bias = getattr(module, "bias", None)
            if found is None or (bias is not None and not _float32_cpu(bias)):
                return None
            tensors.extend([found[0]] + ([bias] if bias is not None else []))
            return {"weight": cast("void *", found[0].data_ptr()),
                    "bias": cast("void *", 0 if bias is None else bias.data_ptr()),
                    "n_out": module.out_features, "n_in": module.in_features, "format": found[1]}

        def norm(module: Any) -> Any:
            if module is None:
                return cast("void *", 0)
            tensors.append(module.weight)
            eps.add(module.eps)
            return cast("void *", module.weight.data_ptr())

        for block in model.blocks:
            attn, ffn = block.attn, block.ffn
            norms = [block.ln1, block.ln2] + [m for m in (attn.q_norm, attn.k_norm) if m is not None]
            if block.cross_attn is not None or not all(isinstance(m, RMSNorm) and _float32_cpu(m.weight)
                                                       for m in norms):
                return None
            spec: dict[str, Any] = {"qkv": linear(attn.qkv), "attn_out": linear(attn.proj),
                                    "ffn_in": linear(ffn.fc), "ffn_out": linear(ffn.proj)}
            if any(v is None for v in spec.values()):
                return None
            spec.update(ln1=norm(block.ln1), ln2=norm(block.ln2), q_norm=norm(attn.q_norm), k_norm=norm(attn.k_norm))
            layers.append(spec)
            scale.add(attn.scale)
        if len(eps) != 1 or len(scale) != 1:
            return None
        return cls(model, layers, tensors, eps.pop(), scale.pop())

    def current(self) -> bool:
        """Whether the weights are still where this description points (model.to() moves them)."""
        return [t.data_ptr() for t in self.tensors] == self.pointers

    def run(self, x: torch.Tensor, rope: RotaryAngles | None, write, want_probs: bool
            ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """x (B, 1, C) embedded -> (B, 1, C) after every block, and with want_probs each layer's
        (B, H, 1, S) probabilities. Stores every layer's new keys and values in `write`'s slots."""
        B, _, C = x.shape
        cache, blocks = write.cache, write.blocks
        x = x.reshape(B, C).clone()  # summed into in place
        cos: torch.Tensor | None = None
        sin: torch.Tensor | None = None
        if self.R:
            assert rope is not None  # a model with rotary positions has their angles
            cos = rope.cos.reshape(-1, self.R).expand(B, self.R).contiguous()  # (B, R): (1, R) or (B, 1, R)
            sin = rope.signed_sin if rope.signed_sin is not None else signed(rope.sin)
            sin = sin.reshape(-1, self.R).expand(B, self.R).contiguous()
        probs: list[torch.Tensor] | None = None
        if want_probs:
            probs = [torch.empty(B, self.H, 1, blocks.n_keys, dtype=torch.float32) for _ in self.fields]
        table, lengths, slots = blocks.table, blocks.lengths, write.slots
        words = self.words
        with self.lock:
            for i, (keys, values, maps) in enumerate(self.fields):
                words[keys], words[values] = cache.keys[i].data_ptr(), cache.values[i].data_ptr()
                words[maps] = probs[i].data_ptr() if probs is not None else 0
            failed = native.load().decode_layers(
                x.data_ptr(), B, C, self.address, len(self.layers), self.H, self.K, self.D, self.F, self.R,
                0 if cos is None else cos.data_ptr(), 0 if sin is None else sin.data_ptr(), slots.data_ptr(),
                table.data_ptr(), table.shape[1], lengths.data_ptr(), cache.block, blocks.n_keys, self.eps,
                self.scale)
        if failed:
            raise MemoryError("decode_layers: out of memory")
        return x.view(B, 1, C), probs


def _plan(model: Any) -> FusedDecode | None:
    """The model's FusedDecode (built on first use; rebuilt when its weights moved), or None."""
    plan = model.__dict__.get("_fused_decode", False)
    if plan is False or (plan is not None and not plan.current()):
        plan = FusedDecode.build(model)
        model.__dict__["_fused_decode"] = plan
    return plan


def forget(model: Any) -> None:
    """Drop the model's FusedDecode: the next fused step describes its weights again."""
    model.__dict__.pop("_fused_decode", None)


def fused_step(model: Any, write, mask) -> FusedDecode | None:
    """The model's FusedDecode when this forward call can take it (module docstring), else None."""
    blocks = getattr(write, "blocks", None)
    if blocks is None or mask is not write.mask or len(blocks.lengths) > MAX_ROWS or not _enabled.get() \
            or model.training or torch.is_grad_enabled() or _hooks.active() is not None:
        return None
    cache = write.cache
    if cache.dtype != torch.float32 or cache.device.type != "cpu" or not native.available()[0]:
        return None
    return _plan(model)
