"""The decoder family (GPT, Llama, Qwen2, Mistral, GPT-NeoX): causal self-attention blocks
and an LM head, from model/parts. Which parts is the config's choice (an architecture is a
config, not a copy of this code).

Shapes: B = batch, T = new tokens in this call, S = all positions the queries may see
(cached + new), C = d_model, H = query heads, K = key/value heads, D = d_head, V = vocab.

    ids (B, T) -> token embedding (+ learned/sinusoidal positions) -> n_layers x Block(causal,
               rotary angles of each token's own position) -> final norm -> LM head

`forward` always returns a DecoderOutput(logits, attentions); attentions is None unless
return_attention=True, then one (B, H, T, S) tensor per layer (one map per query head).
Positions, rotary or not, come from each cache row's own length; a sliding window
(config.sliding_window) masks keys more than `sliding_window - 1` positions back.

The family's declaration (`FAMILY`, model/families/contract.py): it generates, continuing a
prompt in one context; it has one attention group, "self" (causal, tokens over tokens).
"""

from __future__ import annotations

import math
from typing import Callable, ClassVar, NamedTuple

import torch
import torch.nn as nn

from attnlens.model.config import ContextLengthError, ModelConfig
from attnlens.model.families.contract import (
    AttentionAnalysis,
    AttentionGroup,
    Family,
    GenerationSpec,
    LensSpec,
    TaskSpec,
    TrainingSpec,
)
from attnlens.model.family_parts import FAMILY_PARTS
from attnlens.model.fused_decode import fused_step
from attnlens.model.hooks import name_hook_points
from attnlens.model.kv_cache import KVCache, bytes_per_row
from attnlens.model.paged_kv_cache import PagedKVCache
from attnlens.model.parts import (
    Block,
    Embeddings,
    KVUpdate,
    RotaryAngles,
    make_norm,
    sinusoidal_table,
    sliding_window_mask,
)
from attnlens.model.parts.linear import Linear

__all__ = ["FAMILY", "ContextLengthError", "DecoderOutput", "KVCache", "Transformer", "sinusoidal_table"]


class DecoderOutput(NamedTuple):
    """What the decoder's forward returns: (B, T, V) logits ((B, 1, V) with last_only) and, with
    return_attention, one (B, H, T, S) probability tensor per layer (else None)."""

    logits: torch.Tensor
    attentions: list[torch.Tensor] | None = None


FAMILY = Family(
    name="decoder",
    description="a decoder-only language model (GPT): causal self-attention and an LM head",
    tasks=(TaskSpec("generate"), TaskSpec("completions"), TaskSpec("chat", needs="chat_template"),
           TaskSpec("attention")),
    groups=(AttentionGroup("self", "tokens", "tokens", causal=True,
                           description="causal self-attention: each token over itself and the tokens before it"),),
    attention_kind="causal",
    output=DecoderOutput,
    generation=GenerationSpec(prompt="prefix", step_groups=("self",)),
    features=("chat_template",),
    builds=FAMILY_PARTS["decoder"],
    training=TrainingSpec("train:LMObjective"),  # next-token prediction over the works
    lens=LensSpec("tokens", "blocks", "next", "the final norm and the LM head"),
)


class Transformer(Embeddings, nn.Module):
    family: ClassVar[Family] = FAMILY

    def __init__(self, config: ModelConfig):
        super().__init__()
        config.validate()
        self.config = config
        self.init_embeddings(config)  # tok_emb, pos_emb | pos_table | rotary, emb_dropout, layer_windows
        self.blocks = nn.ModuleList(Block(config, causal=True) for _ in range(config.n_layers))
        # Post-LN already normalises every block's output; pre-LN needs a final norm.
        self.ln_f = make_norm(config) if config.norm == "pre" else nn.Identity()
        self.lm_head = Linear(config.d_model, config.vocab_size, bias=config.lm_head_bias)  # GPT-J's has a bias
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2: scale the projections that write into the residual stream by 1/sqrt(2 n_layers).
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("ffn.proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layers))
        name_hook_points(self)  # every HookPoint's name is its path: "blocks.2.attn.hook_z"

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def new_kv_cache(self, n_rows: int = 1, *, paged: bool = False, pool_bytes: int | None = None):
        """An empty cache with `n_rows` rows (slots), each up to the context length, holding the
        key/value heads (n_kv_heads: fewer than the query heads with grouped-query attention).
        `paged`: blocks from one pool of `pool_bytes` (model/paged_kv_cache.py), memory for the tokens
        in flight only; else every row's whole context at once (model/kv_cache.py)."""
        c, p = self.config, next(self.parameters())  # device and dtype
        if paged:
            return PagedKVCache(c.n_layers, n_rows, c.kv_heads, c.context_length, c.d_head, device=p.device,
                                dtype=p.dtype, pool_bytes=pool_bytes)
        return KVCache(c.n_layers, n_rows, c.kv_heads, c.context_length, c.d_head, device=p.device, dtype=p.dtype)

    def kv_cache_row_bytes(self) -> int:
        """What one row of new_kv_cache takes, without allocating it."""
        c = self.config
        return bytes_per_row(c.n_layers, c.kv_heads, c.context_length, c.d_head, self.dtype)

    def forward(
        self,
        ids: torch.Tensor,
        *,
        return_attention: bool = False,
        kv_cache: KVCache | None = None,
        rows: slice | None = None,
        last_only: bool = False,
        valid: torch.Tensor | None = None,
    ) -> DecoderOutput:
        """Logits (B, T, V) for token ids (B, T); (B, 1, V) with last_only.

        With a kv_cache, `ids` are the tokens after the cached ones of the cache rows `rows`
        (default: rows 0 .. B-1); each row continues from its own length. `valid` (B,) says
        how many of each row's T tokens are real, the rest being right padding (prompts of
        different lengths prefilled together): the cache keeps only the real ones, and
        last_only keeps each row's last real position.
        """
        B, T = ids.shape
        write = kv_cache.begin(rows, B, T) if kv_cache is not None else None
        if write is None and T > self.config.context_length:
            raise ContextLengthError(
                f"sequence of {T} tokens exceeds the context length {self.config.context_length}"
            )
        if write is None:  # positions 0 .. T-1
            x, ropes, masks = self.embed(ids), self.layer_rotary_angles(T), self.window_masks(T, T)
        elif write.positions is None:  # every row continues from the same position
            start = write.start
            x, ropes = self.embed(ids, start=start), self.layer_rotary_angles(T, start=start)
            masks = self.window_masks(T, write.n_keys, start=start)
        else:  # each row its own (B, T) positions
            positions = write.positions
            x, ropes = self.embed(ids, positions=positions), self.layer_rotary_angles(T, positions=positions)
            masks = self.window_masks(T, write.n_keys, positions=positions, mask=write.mask)
        if write is not None and self.windowed(write.n_keys):
            write.narrowed = True  # the rows' mask is narrowed: a cache in blocks gathers the keys

        # the fused step takes one mask and one set of angles for every layer (it refuses models
        # whose layers differ: model/fused_decode.py)
        fused = fused_step(self, write, masks[0]) if write is not None else None
        if fused is not None:  # a decode step through every block in one C call (model/fused_decode.py)
            x, attentions = fused.run(x, ropes[0], write, return_attention)
        else:
            x, attentions = self.run_blocks(x, masks, write.layer if write is not None else None, return_attention,
                                            ropes=ropes)
        if kv_cache is not None and write is not None:
            kv_cache.commit(write, T if valid is None else valid.cpu())

        if last_only:  # the final norm is per position: normalise only the one we keep
            if valid is None:
                x = x[:, -1:, :]
            else:  # each row's last real position: (B, T, C) -> (B, 1, C)
                x = x[torch.arange(B, device=x.device), valid.to(x.device) - 1][:, None, :]
        return DecoderOutput(self.unembed(x), attentions)  # (B, T, V)

    def decode_fixed(self, ids: torch.Tensor, kv_cache: KVCache, lengths: torch.Tensor, *,
                     return_attention: bool = False) -> DecoderOutput:
        """One decode step for cache rows 0 .. B-1 with shapes that never change, for CUDA graphs.

        ids (B, 1) and lengths (B,) (each row's filled positions) are tensors on the model's
        device; the new keys/values go to position lengths[b] of row b, and every query looks
        over the whole capacity P with a mask (keys 0 .. lengths[b]). No value is read back
        to the host, so the step can be captured once and replayed. kv_cache.lengths is not
        advanced: the caller does that. Returns (B, 1, V) logits and, with return_attention, one
        (B, H, 1, P) probability tensor per layer (keys past a row's length exactly 0).
        """
        B = ids.shape[0]
        positions = lengths[:, None]  # (B, 1): each row's new token sits at its length
        x = self.embed(ids, positions=positions, dropout=False)  # (B, 1, C)
        ropes = self.layer_rotary_angles(1, positions=positions)  # each layer's (B, 1, R) angles, or None
        keys = torch.arange(kv_cache.capacity, device=ids.device)  # (P,)
        seen = (keys[None, :] <= lengths[:, None])[:, None, None, :]  # (B, P) -> (B, 1, 1, P)
        masks = self.window_masks(1, kv_cache.capacity, positions=positions, mask=seen)
        rows = torch.arange(B, device=ids.device)
        x, attentions = self.run_blocks(x, masks, lambda i: kv_cache.fixed_update(i, rows, lengths), return_attention,
                                        ropes=ropes)
        return DecoderOutput(self.unembed(x), attentions)  # (B, 1, V)

    def windowed(self, n_keys: int) -> bool:
        """Whether a sliding window narrows the keys some layer's queries see among n_keys."""
        window = self.config.sliding_window
        return window is not None and n_keys > window

    def window_masks(self, n: int, n_keys: int, *, start: int = 0, positions: torch.Tensor | None = None,
                     mask: torch.Tensor | None = None) -> list[torch.Tensor | None]:
        """Each layer's mask: window_mask for the layers with a sliding window (layer_windows),
        `mask` itself for the others; made once, shared by the layers of a kind."""
        windowed = self.window_mask(n, n_keys, start=start, positions=positions, mask=mask)
        return [windowed if window is not None else mask for window in self.layer_windows]

    def window_mask(self, n: int, n_keys: int, *, start: int = 0, positions: torch.Tensor | None = None,
                    mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """`mask` narrowed to the sliding window of n queries (at start .. start+n-1, or each row's
        (B, T) `positions`) over n_keys keys: (T, S) or (B, 1, T, S). Unchanged without a window,
        or when every key is within it."""
        if not self.windowed(n_keys):
            return mask
        window = self.config.sliding_window
        assert window is not None  # windowed says so
        if positions is None:
            positions = torch.arange(start, start + n, device=self.device)  # (T,)
        band = sliding_window_mask(positions, n_keys, window)  # (T, S) or (B, T, S)
        if band.dim() == 3:
            band = band[:, None]  # (B, 1, T, S): the same for every head
        return band if mask is None else mask & band

    def run_blocks(self, x: torch.Tensor, masks: list[torch.Tensor | None],
                   kv_update: Callable[[int], KVUpdate] | None, return_attention: bool, *,
                   ropes: list[RotaryAngles | None]) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """x (B, T, C) through every block (layer i's cache through kv_update(i), its mask masks[i]
        and the rotary angles of the tokens' positions ropes[i]: window_masks, layer_rotary_angles);
        with return_attention, each layer's (B, H, T, S) probabilities."""
        attentions: list = []  # each layer's maps (None for a block its hooks gave: model/hooks.py)
        for i, block in enumerate(self.blocks):
            out = block(x, mask=masks[i], kv_update=kv_update(i) if kv_update is not None else None,
                        return_attention=return_attention, rope=ropes[i])
            x = out.x
            if return_attention:
                attentions.append(out.self_attention)
        return x, attentions if return_attention else None

    # --- the family contract (model/families/contract.py) --------------------------------
    @torch.inference_mode()
    def analyse(self, ids: list[int], target_ids: list[int] | None = None) -> AttentionAnalysis:
        """Every layer's and head's map of one sequence: {"self": (L, H, T, T)}."""
        if target_ids is not None:
            raise ValueError("a decoder analyses one sequence: it takes no target")
        inputs = torch.tensor([ids], dtype=torch.long, device=self.device)
        attentions = self(inputs, return_attention=True, last_only=True).attentions
        return AttentionAnalysis({"tokens": list(ids)}, {"self": torch.stack([a[0] for a in attentions])})

    @torch.inference_mode()
    def run_sequence(self, tokens: dict[str, list[int]]) -> None:
        """One forward of an analysed sequence for its intermediates (model/analysis/attention_maps.py), to
        the cheapest output: the last position's logits."""
        self(torch.tensor([tokens["tokens"]], dtype=torch.long, device=self.device), last_only=True)

    def sequence(self, ids: list[int], target_ids: list[int] | None = None) -> tuple[dict[str, list[int]], bool]:
        if target_ids is not None:
            raise ValueError("a decoder reads one sequence: it takes no target")
        return {"tokens": list(ids)}, False

    def stream_logits(self, tokens: dict[str, list[int]]) -> torch.Tensor:
        """(T, V): position t's logits for token t + 1."""
        inputs = torch.tensor([tokens["tokens"]], dtype=torch.long, device=self.device)
        return self(inputs).logits[0]

    def unembed(self, x: torch.Tensor) -> torch.Tensor:
        """(..., C) residual -> (..., V) logits: the final norm, the LM head, Granite's divisor
        (config.logits_divisor) and Gemma 2's cap (config.final_softcap: cap * tanh(logits / cap))."""
        logits = self.lm_head(self.ln_f(x))
        if self.config.logits_divisor != 1.0:
            logits = logits / self.config.logits_divisor
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def step_attention(self, output: DecoderOutput, cache: KVCache, rows: slice,
                       queries: list[int]) -> list[dict[str, list[torch.Tensor]]]:
        """Per row b of `rows`: {"self": per layer (H, n_b)}, query queries[b] over the n_b
        positions the row holds (never the padding of longer rows)."""
        if output.attentions is None:
            raise ValueError("step_attention needs a forward with return_attention=True")
        out = []
        for b, q in enumerate(queries):
            n = int(cache.lengths[rows.start + b])
            out.append({"self": [a[b, :, q, :n] for a in output.attentions]})
        return out
