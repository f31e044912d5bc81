"""The encoder-decoder family (Vaswani et al. 2017), stacked from model/parts.py.

Shapes: B = batch, S = source positions, T = target positions in this call, K = target keys
the queries may see (cached + new), C = d_model, H = heads, D = d_head, V = vocab, L = layers.

    source (B, S) -> token embedding (* sqrt(C)) + positions -> L x Block(bidirectional,
                     source padding mask) -> encoder norm -> memory (B, S, C)
    memory        -> per decoder layer, cross-attention keys/values (B, H, S, D), once
    target (B, T) -> token embedding (* sqrt(C)) + positions -> L x Block(causal self-attention,
                     cross-attention over memory, FFN) -> decoder norm -> LM head -> (B, T, V)

One vocabulary serves both languages; the token embedding is shared by the source, the
target and the LM head (as in the paper). The final LayerNorm of each stack is that of
torch.nn.Transformer, which the parity test compares against. `config.n_layers` is the
number of layers on each side.

Decoding: `new_kv_cache(n_rows)` gives a TranslationCache: the decoder's per-row KV cache
(model/kv_cache.py) plus, per row, the cross-attention keys/values of that row's source.
`forward(start_ids, source=src, kv_cache=cache, rows=r)` encodes the source into rows r
and feeds the first target tokens; later calls `forward(next_ids, kv_cache=cache, rows=r)`
reuse the cached cross K/V and never run the encoder again.

Each side's blocks sit at `encoder.blocks` / `decoder.blocks` (a `Stack`), so their module paths
are their hook names (model/hooks.py: "decoder.blocks.1.cross_attn.hook_z"). Checkpoints store
them as "encoder_blocks.{l}..." / "decoder_blocks.{l}..." (where the attributes used to be):
`state_dict` writes those names and `load_state_dict` reads them (STORED_NAMES), so the committed
checkpoints load as they are, while `named_parameters` gives the paths.
"""

from __future__ import annotations

from typing import ClassVar, Iterable, NamedTuple

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
from attnlens.model.families.decoder import Transformer
from attnlens.model.family_parts import FAMILY_PARTS
from attnlens.model.hooks import name_hook_points
from attnlens.model.kv_cache import KVCache, bytes_per_row, move_row
from attnlens.model.parts import Block, Embeddings
from attnlens.model.parts.linear import Linear


class EncoderDecoderOutput(NamedTuple):
    """What the encoder-decoder's forward returns. Every attention entry is None unless
    return_attention=True; then one tensor per layer:

    attentions          decoder self-attention (B, H, T, K), causal
    encoder_attentions  encoder self-attention (B, H, S, S); None when the source was encoded
                        by an earlier call (cached)
    cross_attentions    decoder -> source (B, H, T, S)
    """

    logits: torch.Tensor  # (B, T, V); (B, 1, V) with last_only
    attentions: list[torch.Tensor] | None = None
    encoder_attentions: list[torch.Tensor] | None = None
    cross_attentions: list[torch.Tensor] | None = None


FAMILY = Family(
    name="encoder-decoder",
    description="an encoder-decoder (Vaswani et al.): a bidirectional encoder reads the source; a causal "
                "decoder writes the target, reading the source through cross-attention",
    tasks=(TaskSpec("generate"), TaskSpec("completions"), TaskSpec("attention")),
    groups=(
        AttentionGroup("encoder", "source", "source", causal=False,
                       description="the encoder's bidirectional self-attention over the source",
                       hook="encoder.blocks.{layer}.attn"),
        AttentionGroup("decoder", "target", "target", causal=True,
                       description="the decoder's causal self-attention over the target",
                       hook="decoder.blocks.{layer}.attn"),
        AttentionGroup("cross", "target", "source", causal=False,
                       description="cross-attention: each target step over the source tokens",
                       hook="decoder.blocks.{layer}.cross_attn"),
    ),
    attention_kind="encoder-decoder",
    output=EncoderDecoderOutput,
    generation=GenerationSpec(prompt="source", step_groups=("decoder", "cross")),
    builds=FAMILY_PARTS["encoder-decoder"],  # none of the optional parts
    # generated (English, French) pairs of dates and numbers, and their own tokenizer
    training=TrainingSpec("train_translation:TranslationObjective", data="own", tokenizer="translation"),
    lens=LensSpec("target", "decoder.blocks", "next", "the decoder's final norm and the LM head"),
)


def key_mask(keep: torch.Tensor | None) -> torch.Tensor | None:
    """(B, S) 1/0 or bool real-token mask -> (B, 1, 1, S) boolean key mask (True = may attend)."""
    return None if keep is None else keep.bool()[:, None, None, :]


def zero_padded_queries(probs: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """Rows of padded query positions are not results: (B, H, T, S) with those rows zeroed."""
    return probs if keep is None else probs * keep.to(probs.dtype)[:, None, :, None]


class TranslationCache:
    """The decoder's self-attention KV cache (a row per request, a length per row) and each
    row's cross-attention keys/values, computed once from its source.

        decoder                        KVCache: keys/values (R, H, P, D) per decoder layer
        cross_keys[l], cross_values[l] (R, H, P_src, D)
        source_lengths                 (R,) int64 on the CPU: real source tokens of each row
    """

    def __init__(self, n_layers: int, n_rows: int, n_heads: int, capacity: int, d_head: int, *,
                 device=None, dtype=None):
        self.decoder = KVCache(n_layers, n_rows, n_heads, capacity, d_head, device=device, dtype=dtype)
        shape = (n_rows, n_heads, capacity, d_head)
        self.cross_keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.cross_values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.source_lengths = torch.zeros(n_rows, dtype=torch.long)
        self.device = device

    # the KVCache interface the decode step and the engine read
    @property
    def lengths(self) -> torch.Tensor:
        return self.decoder.lengths

    @property
    def n_rows(self) -> int:
        return self.decoder.n_rows

    @property
    def capacity(self) -> int:
        return self.decoder.capacity

    def row_slice(self, rows: slice | None, batch: int) -> slice:
        return self.decoder.row_slice(rows, batch)

    @property
    def keys(self) -> list[torch.Tensor]:
        """Every key tensor held (decoder self-attention, then cross-attention), e.g. to size it."""
        return self.decoder.keys + self.cross_keys

    @property
    def values(self) -> list[torch.Tensor]:
        return self.decoder.values + self.cross_values

    # --- the source side ---------------------------------------------------------------
    def store_source(self, rows: slice, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep one decoder layer's cross keys/values (B, H, S, D) for rows `rows`."""
        S = k.shape[2]
        self.cross_keys[layer][rows, :, :S] = k
        self.cross_values[layer][rows, :, :S] = v

    def source_width(self, rows: slice) -> int:
        return int(self.source_lengths[rows].max())

    def memory_kv(self, rows: slice, layer: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, H, width, D) cross keys and values of rows `rows` (views, no copy)."""
        return self.cross_keys[layer][rows, :, :width], self.cross_values[layer][rows, :, :width]

    def source_keep(self, rows: slice, width: int) -> torch.Tensor:
        """(B, width) True at each row's real source positions."""
        return (torch.arange(width)[None, :] < self.source_lengths[rows][:, None]).to(self.device)

    # --- rows --------------------------------------------------------------------------
    def free(self, row: int) -> None:
        self.decoder.free(row)
        self.source_lengths[row] = 0

    def move(self, src: int, dst: int) -> None:
        self.decoder.move(src, dst)
        move_row(self.cross_keys + self.cross_values, self.source_lengths, src, dst)

    def reset(self) -> None:
        self.decoder.reset()
        self.source_lengths.zero_()


# module path prefix -> the name checkpoints store it under
STORED_NAMES = {"encoder.blocks.": "encoder_blocks.", "decoder.blocks.": "decoder_blocks."}


def _renamed(state: dict, prefix: str, names: dict[str, str]) -> None:
    """Rename `state`'s keys in place (their order kept): prefix + old... -> prefix + new..."""
    items = list(state.items())
    state.clear()
    for key, value in items:
        for old, new in names.items():
            if key.startswith(prefix + old):
                key = prefix + new + key[len(prefix + old):]
                break
        state[key] = value


def _to_stored_names(module, state, prefix, local_metadata) -> None:
    """state_dict post-hook: the keys checkpoints store ("encoder_blocks.0.attn.qkv.weight")."""
    _renamed(state, prefix, STORED_NAMES)


def _from_stored_names(module, state, prefix, *args) -> None:
    """load_state_dict pre-hook: stored keys back to module paths ("encoder.blocks.0.attn.qkv.weight")."""
    _renamed(state, prefix, {new: old for old, new in STORED_NAMES.items()})


class Stack(nn.Module):
    """One side's blocks, at `blocks`: the encoder-decoder's `encoder.blocks.{l}` and `decoder.blocks.{l}`."""

    def __init__(self, blocks: Iterable[Block]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)


class EncoderDecoder(Embeddings, nn.Module):
    family: ClassVar[Family] = FAMILY

    def __init__(self, config: ModelConfig):
        super().__init__()
        config.validate()
        self.config = config
        C = config.d_model
        self.init_embeddings(config)  # tok_emb (shared: source, target, LM head), positions, dropout
        self.encoder = Stack(Block(config, causal=False) for _ in range(config.n_layers))
        self.encoder_norm = nn.LayerNorm(C, eps=config.layer_norm_eps, bias=config.bias)
        self.decoder = Stack(Block(config, causal=True, cross_attention=True) for _ in range(config.n_layers))
        self.decoder_norm = nn.LayerNorm(C, eps=config.layer_norm_eps, bias=config.bias)
        self.lm_head = Linear(C, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(Transformer._init_weights)
        name_hook_points(self)  # every HookPoint's name is its path: "decoder.blocks.1.cross_attn.hook_z"
        self.register_state_dict_post_hook(_to_stored_names)
        self.register_load_state_dict_pre_hook(_from_stored_names)

    def new_kv_cache(self, n_rows: int = 1) -> TranslationCache:
        c, p = self.config, next(self.parameters())  # device and dtype
        return TranslationCache(c.n_layers, n_rows, c.n_heads, c.context_length, c.d_head,
                                device=p.device, dtype=p.dtype)

    def kv_cache_row_bytes(self) -> int:
        """What one row of new_kv_cache takes, without allocating it: the decoder's keys and values,
        and as much again for the cross-attention keys and values of the row's source."""
        c = self.config
        return 2 * bytes_per_row(c.n_layers, c.n_heads, c.context_length, c.d_head, self.dtype)

    def check_length(self, n: int, what: str) -> None:
        if n > self.config.context_length:
            raise ContextLengthError(
                f"{what} of {n} tokens exceeds the context length {self.config.context_length}")

    # --- the two stacks (on embeddings: what torch.nn.Transformer computes) -------------
    def encoder_stack(self, x: torch.Tensor, source_keep: torch.Tensor | None = None,
                      return_attention: bool = False):
        """(B, S, C) embedded source -> memory (B, S, C), encoder attentions or None."""
        mask = key_mask(source_keep)
        attentions: list[torch.Tensor] | None = [] if return_attention else None
        for block in self.encoder.blocks:
            out = block(x, mask=mask, return_attention=return_attention)
            x = out.x
            if attentions is not None:  # return_attention
                attentions.append(zero_padded_queries(out.self_attention, source_keep))
        return self.encoder_norm(x), attentions

    def cross_kv(self, memory: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every decoder layer's cross-attention keys/values (B, H, S, D) of memory (B, S, C)."""
        return [block.cross_attn.project_memory(memory) for block in self.decoder.blocks]

    def decoder_stack(self, y: torch.Tensor, memory_kv, *, source_keep=None, self_mask=None,
                      target_keep=None, write=None, return_attention: bool = False):
        """(B, T, C) embedded target -> (B, T, C) decoder states, self and cross attentions.

        memory_kv: per layer (k, v) from `cross_kv`; source_keep (B, S) masks the source keys;
        self_mask (broadcastable to (B, H, T, K)) is added to causality (target padding, or
        the cache's per-row mask); `write` is the KV cache's CacheWrite for this call.
        """
        memory_mask = key_mask(source_keep)
        self_attn: list[torch.Tensor] | None = [] if return_attention else None
        cross_attn: list[torch.Tensor] | None = [] if return_attention else None
        for i, block in enumerate(self.decoder.blocks):
            out = block(y, mask=self_mask, kv_update=write.layer(i) if write is not None else None,
                        return_attention=return_attention, memory_kv=memory_kv[i], memory_mask=memory_mask)
            y = out.x
            if self_attn is not None and cross_attn is not None:  # return_attention
                self_attn.append(zero_padded_queries(out.self_attention, target_keep))
                cross_attn.append(zero_padded_queries(out.cross_attention, target_keep))
        return self.decoder_norm(y), self_attn, cross_attn

    # --- the model -----------------------------------------------------------------------
    def encode(self, source: torch.Tensor, source_mask: torch.Tensor | None = None,
               return_attention: bool = False):
        """(B, S) source ids [+ (B, S) real-token mask] -> memory (B, S, C), encoder attentions."""
        self.check_length(source.shape[1], "source")
        return self.encoder_stack(self.embed(source), source_mask, return_attention)

    def forward(
        self,
        ids: torch.Tensor,
        *,
        source: torch.Tensor | None = None,
        source_mask: torch.Tensor | None = None,
        target_mask: torch.Tensor | None = None,
        kv_cache: TranslationCache | None = None,
        rows: slice | None = None,
        return_attention: bool = False,
        last_only: bool = False,
        valid: torch.Tensor | None = None,
    ) -> EncoderDecoderOutput:
        """Logits (B, T, V) for target ids (B, T) (the decoder's inputs: start token first).

        Without a cache: `source` (B, S) is required; `source_mask` / `target_mask` (B, S) /
        (B, T), True/1 at real tokens, are the padding masks (right padding).
        With a cache: `source` given encodes it into rows `rows` (a new request; those rows'
        decoder state starts empty); without it, the rows' cached sources are used and `ids`
        continue each row's target from its own length.

        A prompt is a source: on cache rows that hold no source yet (new or freed), `ids`
        (B, S) ARE the source; it is encoded and the decoder is fed its start token
        (config.decoder_start_id), so the logits (B, 1, V) give the first target token. This
        is how the decoder family's prefill (`model(prompt, kv_cache=, rows=)`) reads for this
        family, so one decode step and one engine serve both. `valid` (B,), as the decoder
        takes it, gives each right-padded prompt's real length: the source padding mask.
        """
        B, T = ids.shape
        encoder_attentions = None
        if kv_cache is None:
            if source is None:
                raise ValueError("the encoder-decoder needs a source (or a cache that holds one)")
            self.check_length(T, "target")
            memory, encoder_attentions = self.encode(source, source_mask, return_attention)
            memory_kv = self.cross_kv(memory)
            mask = key_mask(target_mask)
            y = self.embed(ids)
            y, self_attn, cross_attn = self.decoder_stack(
                y, memory_kv, source_keep=source_mask, self_mask=mask, target_keep=target_mask,
                return_attention=return_attention)
        else:
            rows = kv_cache.row_slice(rows, B)
            if source is None and int(kv_cache.source_lengths[rows].max()) == 0:  # a prompt: the source
                source = ids
                source_mask = None if valid is None else (
                    torch.arange(ids.shape[1], device=ids.device)[None, :] < valid.to(ids.device)[:, None])
                valid = None
                ids = torch.full((B, 1), self.config.decoder_start_id, dtype=torch.long, device=ids.device)
                B, T = ids.shape
            if source is not None:  # a new request: encode once, keep every layer's cross K/V
                memory, encoder_attentions = self.encode(source, source_mask, return_attention)
                lengths = (torch.full((B,), source.shape[1], dtype=torch.long) if source_mask is None
                           else source_mask.long().sum(dim=1).cpu())
                kv_cache.source_lengths[rows] = lengths
                for i, (k, v) in enumerate(self.cross_kv(memory)):
                    kv_cache.store_source(rows, i, k, v)
                for r in range(rows.start, rows.stop):
                    kv_cache.decoder.free(r)
            if valid is not None:
                raise ValueError("right-padded target tokens (valid=) are not supported: decode rows step by step")
            if int(kv_cache.source_lengths[rows].min()) == 0:
                raise ValueError(f"cache rows {rows} mix rows with and without a source: "
                                 "start new requests in their own call")
            width = kv_cache.source_width(rows)
            memory_kv = [kv_cache.memory_kv(rows, i, width) for i in range(self.config.n_layers)]
            write = kv_cache.decoder.begin(rows, B, T)
            if write.positions is None:  # every row continues from the same position
                y = self.embed(ids, start=write.start)
            else:
                y = self.embed(ids, positions=write.positions)
            y, self_attn, cross_attn = self.decoder_stack(
                y, memory_kv, source_keep=kv_cache.source_keep(rows, width), self_mask=write.mask,
                write=write, return_attention=return_attention)
            kv_cache.decoder.commit(write, T)
        if last_only:
            y = y[:, -1:, :]
        return EncoderDecoderOutput(self.lm_head(y), self_attn, encoder_attentions, cross_attn)


    # --- the family contract (model/families/contract.py) --------------------------------
    @torch.inference_mode()
    def analyse(self, ids: list[int], target_ids: list[int] | None = None) -> AttentionAnalysis:
        """The three groups of a source `ids` and its target (without the start token; None: the
        model's own greedy translation, at most context - 1 tokens so start + target fit)."""
        start = self.config.decoder_start_id
        generated = target_ids is None
        if target_ids is None:
            target_ids = greedy_translate_ids(self, [ids], start, start,
                                              max_new_tokens=self.config.context_length - 1)[0]
        decoder_ids = [start, *target_ids]
        enc, dec, cross = attention_groups(self, list(ids), decoder_ids)
        return AttentionAnalysis({"source": list(ids), "target": decoder_ids},
                                 {"encoder": enc, "decoder": dec, "cross": cross}, generated_target=generated)

    @torch.inference_mode()
    def sequence(self, ids: list[int], target_ids: list[int] | None = None) -> tuple[dict[str, list[int]], bool]:
        """{"source": ids, "target": start + target}; without a target the greedy translation."""
        start = self.config.decoder_start_id
        generated = target_ids is None
        if target_ids is None:
            target_ids = greedy_translate_ids(self, [ids], start, start,
                                              max_new_tokens=self.config.context_length - 1)[0]
        return {"source": list(ids), "target": [start, *target_ids]}, generated

    @torch.inference_mode()
    def run_sequence(self, tokens: dict[str, list[int]]) -> None:
        """One forward of a source and its target (start token first) for their intermediates
        (model/analysis/attention_maps.py), to the cheapest output: the last target position's logits."""
        device = self.device
        self(torch.tensor([tokens["target"]], dtype=torch.long, device=device),
             source=torch.tensor([tokens["source"]], dtype=torch.long, device=device), last_only=True)

    def stream_logits(self, tokens: dict[str, list[int]]) -> torch.Tensor:
        """(T, V): decoder position t's logits for target token t + 1 (position 0 is the start token)."""
        device = self.device
        src = torch.tensor([tokens["source"]], dtype=torch.long, device=device)
        tgt = torch.tensor([tokens["target"]], dtype=torch.long, device=device)
        return self(tgt, source=src).logits[0]

    def unembed(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.decoder_norm(x))

    def step_attention(self, output: EncoderDecoderOutput, cache: TranslationCache, rows: slice,
                       queries: list[int]) -> list[dict[str, list[torch.Tensor]]]:
        """Per row b of `rows`: {"decoder": per layer (H, n_b) over the target it has written,
        "cross": per layer (H, m_b) over its own source}, for query position queries[b]."""
        out = []
        for b, q in enumerate(queries):
            n, m = int(cache.lengths[rows.start + b]), int(cache.source_lengths[rows.start + b])
            out.append({"decoder": [a[b, :, q, :n] for a in output.attentions],
                        "cross": [c[b, :, q, :m] for c in output.cross_attentions]})
        return out


def decoder_start_id(tokenizer) -> int:
    """The token that starts every target (and ends it): the tokenizer's EOS (id 0 in every
    tokenizer attnlens trains, which is config.decoder_start_id's default)."""
    return tokenizer.eos_id


@torch.inference_mode()
def greedy_translate_ids(model: EncoderDecoder, sources: list[list[int]], start_id: int, end_id: int,
                         max_new_tokens: int | None = None) -> list[list[int]]:
    """Greedy translations of a batch of tokenised sources (without the end token), with the
    cached cross K/V and the per-row decoder cache; all rows step together."""
    device = model.device
    B = len(sources)
    S = max(len(s) for s in sources)
    src = torch.zeros(B, S, dtype=torch.long, device=device)
    keep = torch.zeros(B, S, dtype=torch.bool, device=device)
    for b, s in enumerate(sources):
        src[b, :len(s)] = torch.tensor(s, dtype=torch.long)
        keep[b, :len(s)] = True
    limit = model.config.context_length if max_new_tokens is None else min(max_new_tokens, model.config.context_length)
    cache = model.new_kv_cache(B)
    inputs = torch.full((B, 1), start_id, dtype=torch.long, device=device)
    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    for step in range(limit):
        logits = model(inputs, source=src if step == 0 else None, source_mask=keep if step == 0 else None,
                       kv_cache=cache, last_only=True).logits[:, -1]  # (B, V)
        nxt = logits.argmax(dim=-1)  # (B,)
        for b, t in enumerate(nxt.tolist()):
            if not done[b]:
                if t == end_id:
                    done[b] = True
                else:
                    out[b].append(t)
        if all(done):
            break
        inputs = nxt[:, None]
    return out


def greedy_translate(model: EncoderDecoder, tokenizer, texts: list[str], batch_size: int = 256) -> list[str]:
    """Greedy translations of `texts`, in order."""
    start = decoder_start_id(tokenizer)
    results: list[str] = []
    for first in range(0, len(texts), batch_size):
        chunk = [tokenizer.encode(t) for t in texts[first:first + batch_size]]
        for ids in greedy_translate_ids(model, chunk, start, start):
            results.append(tokenizer.decode(ids))
    return results


@torch.inference_mode()
def attention_groups(model: EncoderDecoder, source_ids: list[int], decoder_ids: list[int]):
    """The three groups of attention maps of one (source, decoder input) pair, each a
    (L, H, ., .) tensor: encoder self (S x S), decoder self (T x T, causal), cross (T x S).
    `decoder_ids` are the decoder's inputs: the start token, then the target."""
    device = model.device
    src = torch.tensor([source_ids], dtype=torch.long, device=device)
    tgt = torch.tensor([decoder_ids], dtype=torch.long, device=device)
    out = model(tgt, source=src, return_attention=True, last_only=True)
    stack = lambda maps: torch.stack([m[0] for m in maps])  # L x (1, H, ., .) -> (L, H, ., .)
    return stack(out.encoder_attentions), stack(out.attentions), stack(out.cross_attentions)
