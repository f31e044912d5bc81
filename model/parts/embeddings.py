"""Token embeddings and the positions added to them (or, for rotary positions, the angles the
attention applies): one mixin every family uses.

Shapes: B = batch, T = positions in this call, C = d_model, V = vocab, P = context length.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from attnlens.model.config import ModelConfig
from attnlens.model.parts.positions import RotaryAngles, RotaryEmbedding, sinusoidal_table


class Embeddings:
    """Mixin for a family's nn.Module: the token + position embedding, written once.

    `init_embeddings` registers the attributes on the model itself, so the state-dict names
    stay `tok_emb.weight` and `pos_emb.weight` (GPT-2/BERT interop and saved checkpoints):
    tok_emb (V, C); pos_emb (P, C) when positions are learned, else pos_emb None and, for
    sinusoidal positions, the non-persistent buffer pos_table (P, C); for rotary positions
    `rotary` (a RotaryEmbedding: nothing is added to the embedding, the attention rotates
    queries and keys by `rotary_angles`); emb_dropout; layer_windows (each layer's sliding window).
    """

    def init_embeddings(self, config: ModelConfig) -> None:
        C = config.d_model
        self.tok_emb = nn.Embedding(config.vocab_size, C)
        self.pos_emb = self.rotary = None
        if config.positional == "learned":
            self.pos_emb = nn.Embedding(config.context_length, C)
        elif config.positional == "sinusoidal":
            self.register_buffer("pos_table", sinusoidal_table(config.context_length, C), persistent=False)
        else:  # rotary
            self.rotary = RotaryEmbedding(config)
        # Gemma 3: the sliding layers' own rotary base (config.rope_local_theta), without scaling
        self.rotary_local = RotaryEmbedding(config, theta=config.rope_local_theta, scaling=False) \
            if config.rope_local_theta is not None else None
        self.emb_dropout = nn.Dropout(config.dropout)
        # each layer's sliding window (config.window_of; None: every earlier position), fixed at load:
        # every forward's masks and rotary bases read it
        self.layer_windows = tuple(config.window_of(i) for i in range(config.n_layers))

    def embed(self, ids: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None, *,
              norm: nn.Module | None = None, dropout: bool = True) -> torch.Tensor:
        """(B, T) ids -> (B, T, C): token embedding (times sqrt(C) if configured) + positions
        start .. start+T-1 (a slice, no index lookup), or each token's own (B, T) `positions`
        (rotary positions add nothing here); then `norm` (BERT's embedding LayerNorm) and
        dropout while training."""
        x = self.tok_emb(ids)  # (B, T, C)
        if self.config.scale_embeddings:  # Gemma: sqrt(C) in the embedding's dtype, as transformers rounds it
            x = x * math.sqrt(self.config.d_model)
        if self.config.embedding_multiplier != 1.0:  # Granite
            x = x * self.config.embedding_multiplier
        if self.rotary is None:
            pos = self.pos_emb.weight if self.pos_emb is not None else self.pos_table  # (P, C)
            if positions is None:
                x = x + pos[start : start + ids.shape[1]].to(x.dtype)
            else:
                x = x + pos[positions].to(x.dtype)  # (B, T) -> (B, T, C)
        if norm is not None:
            x = norm(x)
        return self.emb_dropout(x) if dropout and self.training else x

    def rotary_angles(self, n: int, start: int = 0, positions: torch.Tensor | None = None) -> RotaryAngles | None:
        """The rotary angles of the same positions `embed` takes (n tokens from `start`, or each
        token's (B, T) `positions`): cos, sin (T, R) or (B, T, R); None without rotary positions."""
        if self.rotary is None:
            return None
        if positions is None:
            positions = torch.arange(start, start + n, device=self.device)  # (T,)
        return self.rotary(positions, self.dtype)

    def layer_rotary_angles(self, n: int, start: int = 0, positions: torch.Tensor | None = None
                            ) -> list[RotaryAngles | None]:
        """rotary_angles for each layer: the sliding layers' own base where the config gives one
        (rope_local_theta), computed once for all of them."""
        angles = self.rotary_angles(n, start, positions)
        if self.rotary_local is None:
            return [angles] * self.config.n_layers
        if positions is None:
            positions = torch.arange(start, start + n, device=self.device)  # (T,)
        local = self.rotary_local(positions, self.dtype)
        return [local if window is not None else angles for window in self.layer_windows]

    @property
    def device(self) -> torch.device:
        """Where the weights are (and so where inputs go). Read from the first parameter, not
        tok_emb.weight: a packed embedding (model/packed/) builds its `weight` on each access."""
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The floating type the model computes in (its parameters' type)."""
        return next(self.parameters()).dtype

    def num_parameters(self, *, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        packed = {id(m.packed): m.packed for m in self.modules() if hasattr(m, "packed")}  # tied: once
        n += sum(pm.rows * pm.cols for pm in packed.values())
        if exclude_embeddings:
            n -= self.tok_emb.num_embeddings * self.tok_emb.embedding_dim
            if self.pos_emb is not None:
                n -= self.pos_emb.weight.numel()
        return n
