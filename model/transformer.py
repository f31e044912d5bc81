"""A decoder-only transformer, written from its parts.

Shapes: B = batch, T = new tokens in this call, S = all positions the queries may see
(cached + new), C = d_model, H = heads, D = d_head = C / H, V = vocab.

    ids (B, T) -> token embedding (+ positions) -> n_layers x Block -> final norm -> LM head

Each Block is multi-head causal self-attention and a position-wise FFN, each wrapped in a
residual connection and a LayerNorm: before the sub-layer ("pre", GPT-2) or after the
residual sum ("post", Vaswani et al. 2017).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig


class ContextLengthError(ValueError):
    """The sequence does not fit in the model's context window."""


def sinusoidal_table(n_positions: int, d_model: int) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d))."""
    pos = torch.arange(n_positions, dtype=torch.float64).unsqueeze(1)  # (P, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (C/2,)
    angle = pos / torch.pow(10000.0, two_i / d_model)  # (P, C/2)
    table = torch.zeros(n_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle)
    return table.float()


class KVCache:
    """Keys and values of every layer, preallocated to the context length.

    `length` positions are filled. A forward call with a cache appends its new keys and
    values and advances `length`, so the next call only feeds the newest token(s).
    """

    def __init__(self, config: ModelConfig, batch_size: int = 1, *, device=None, dtype=None):
        shape = (batch_size, config.n_heads, config.context_length, config.d_head)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.length = 0
        self.capacity = config.context_length

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store (B, H, T, D) keys/values after the cached ones; return all (B, H, S, D)."""
        start, end = self.length, self.length + k.shape[2]
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, n: int) -> None:
        self.length += n

    def reset(self) -> None:
        self.length = 0


def causal_mask(n_queries: int, n_keys: int, device=None) -> torch.Tensor:
    """(T, S) boolean mask, True where query i (at absolute position S - T + i) may look."""
    offset = n_keys - n_queries
    return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).tril(diagonal=offset)


class CausalSelfAttention(nn.Module):
    """Multi-head attention: softmax(Q K^T / sqrt(d_head)) V per head, then an output projection."""

    def __init__(self, config: ModelConfig, layer_index: int, causal: bool = True):
        super().__init__()
        self.layer_index = layer_index
        self.causal = causal  # False: bidirectional (the encoder), masked only by attn_mask
        self.n_heads = config.n_heads
        self.d_head = config.d_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None, return_attention: bool = False,
                attn_mask: torch.Tensor | None = None):
        """attn_mask: optional boolean (B, 1, T|1, S), True where a query may look (padding)."""
        B, T, C = x.shape
        # (B, T, 3C) -> (3, B, H, T, D): q, k, v as views, heads split out
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.d_head).permute(2, 0, 3, 1, 4).unbind(0)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_index, k, v)  # (B, H, S, D)
        S = k.shape[2]
        dropout_p = self.dropout if self.training else 0.0

        if return_attention:
            y, probs = self.explicit_attention(q, k, v, dropout_p, attn_mask)
        elif not self.causal:
            probs = None
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
        else:
            probs = None
            if T == 1:  # a single newest query may see every cached key
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
            elif S == T:
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
            else:
                mask = causal_mask(T, S, device=x.device)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)

        y = self.proj(y.transpose(1, 2).reshape(B, T, C))  # re-assemble heads, project
        if self.training:  # dropout is the identity at inference; skip the call when decoding
            y = self.resid_dropout(y)
        return y, probs

    def explicit_attention(self, q, k, v, dropout_p: float, attn_mask: torch.Tensor | None = None):
        """The textbook formula, keeping the probabilities: (B, H, T, S)."""
        T, S = q.shape[2], k.shape[2]
        scores = (q @ k.transpose(-2, -1)).mul_(1.0 / math.sqrt(self.d_head))  # (B, H, T, S)
        if self.causal:
            scores.masked_fill_(~causal_mask(T, S, device=q.device), float("-inf"))  # in place: a fresh tensor
        if attn_mask is not None:
            scores.masked_fill_(~attn_mask, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        weights = F.dropout(probs, p=dropout_p) if dropout_p > 0 else probs
        return weights @ v, probs  # (B, H, T, D), (B, H, T, S)


def activate(x: torch.Tensor, name: str) -> torch.Tensor:
    """The config's activation: "gelu" (tanh approximation), "gelu_exact" (erf) or "relu"."""
    if name == "gelu":
        return F.gelu(x, approximate="tanh")
    if name == "gelu_exact":
        return F.gelu(x)
    return F.relu(x)


class FeedForward(nn.Module):
    """Position-wise FFN: Linear(C -> d_ff), GELU or ReLU (see `activate`), Linear(d_ff -> C)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.proj = nn.Linear(config.d_ff, config.d_model, bias=config.bias)
        self.activation = config.activation
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = activate(h, self.activation)
        h = self.proj(h)
        return self.dropout(h) if self.training else h


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, causal: bool = True):
        super().__init__()
        self.pre_norm = config.norm == "pre"
        self.ln1 = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer_index, causal)
        self.ln2 = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps, bias=config.bias)
        self.ffn = FeedForward(config)

    def forward(self, x, kv_cache=None, return_attention=False, attn_mask=None):
        if self.pre_norm:
            a, probs = self.attn(self.ln1(x), kv_cache, return_attention, attn_mask)
            x = x + a
            x = x + self.ffn(self.ln2(x))
        else:
            a, probs = self.attn(x, kv_cache, return_attention, attn_mask)
            x = self.ln1(x + a)
            x = self.ln2(x + self.ffn(x))
        return x, probs


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        config.validate()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        if config.positional == "learned":
            self.pos_emb = nn.Embedding(config.context_length, config.d_model)
        else:
            self.pos_emb = None
            self.register_buffer(
                "pos_table", sinusoidal_table(config.context_length, config.d_model), persistent=False
            )
        self.emb_dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        # Post-LN already normalises every block's output; pre-LN needs a final norm.
        self.ln_f = (
            nn.LayerNorm(config.d_model, eps=config.layer_norm_eps, bias=config.bias)
            if config.norm == "pre"
            else nn.Identity()
        )
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2: scale the projections that write into the residual stream by 1/sqrt(2 n_layers).
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("ffn.proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self, *, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.tok_emb.weight.numel()
            if self.pos_emb is not None:
                n -= self.pos_emb.weight.numel()
        return n

    def new_kv_cache(self, batch_size: int = 1) -> KVCache:
        p = self.tok_emb.weight
        return KVCache(self.config, batch_size, device=p.device, dtype=p.dtype)

    def forward(
        self,
        ids: torch.Tensor,
        *,
        return_attention: bool = False,
        kv_cache: KVCache | None = None,
        last_only: bool = False,
    ):
        """Logits (B, T, V) for token ids (B, T); (B, 1, V) with last_only.

        With a kv_cache, `ids` are the tokens after the cached ones. With return_attention,
        returns (logits, attentions), attentions being one (B, H, T, S) tensor per layer.
        """
        B, T = ids.shape
        start = kv_cache.length if kv_cache is not None else 0
        if start + T > self.config.context_length:
            raise ContextLengthError(
                f"sequence of {start + T} tokens exceeds the context length "
                f"{self.config.context_length}"
            )
        x = self.tok_emb(ids)  # (B, T, C)
        if self.config.scale_embeddings:
            x = x * math.sqrt(self.config.d_model)
        # positions start .. start+T-1 are contiguous rows: slice them, no index lookup
        pos = self.pos_emb.weight if self.pos_emb is not None else self.pos_table
        x = x + pos[start : start + T].to(x.dtype)
        if self.training:
            x = self.emb_dropout(x)

        attentions = []
        for block in self.blocks:
            x, probs = block(x, kv_cache, return_attention)
            if return_attention:
                attentions.append(probs)
        if kv_cache is not None:
            kv_cache.advance(T)

        if last_only:  # the final norm is per position: normalise only the one we keep
            x = x[:, -1:, :]
        x = self.ln_f(x)
        logits = self.lm_head(x)  # (B, T, V)
        return (logits, attentions) if return_attention else logits
