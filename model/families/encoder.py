"""An encoder-only transformer (BERT's shape), stacked from the decoder's own parts.

Shapes: B = batch, T = positions, C = d_model, H = heads, V = vocab, L = labels.

    ids (B, T) -> token embedding + positions -> LayerNorm -> n_layers x Block(bidirectional)
               -> [final norm if pre-LN] -> hidden (B, T, C)
    hidden -> MLM head: Linear(C, C) -> activation -> LayerNorm -> tied embedding^T + bias -> (B, T, V)
    hidden -> pool -> classification head: Linear(C, C) -> tanh -> Linear(C, L) -> (B, L)
    hidden -> pool -> L2 normalise -> sentence embeddings (B, C) (sentence_embeddings, /v1/embeddings)

With config.classifier_layers = k > 0 the classification head has its own k blocks, copies of
the top k fine-tuned for it (all-MiniLM-L6-v2's genre head): classify reads the state after the
shared blocks 0..n-k-1 through those instead, so the encoder's other answers (embeddings,
fill-mask, attention) stay the pretrained model's own.

The Blocks, attention, FFN and norms are the shared ones in model/parts.py, built with
causal=False: every position sees every other, and a padding mask (`attention_mask`,
True/1 for real tokens as in Hugging Face) gives padded keys exactly zero weight.

Pooling for the classification head is the mean over non-padding positions by default
(`pooling="mean"`): a small model pretrained only with masked-LM never trains its [CLS]
position to summarise the passage (no next-sentence task), while the mean of all positions
starts out as a useful summary, so fine-tuning has less to learn. `pooling="cls"` (BERT's
choice) is available. Both read only real positions: padding never changes a prediction.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from attnlens.model.config import ContextLengthError, ModelConfig
from attnlens.model.families.contract import AttentionAnalysis, AttentionGroup, Family, LensSpec, TaskSpec, TrainingSpec
from attnlens.model.families.decoder import Transformer
from attnlens.model.family_parts import FAMILY_PARTS
from attnlens.model.hooks import name_hook_points
from attnlens.model.parts import Block, Embeddings, activate
from attnlens.model.parts.linear import Linear

TASKS = ("mlm", "classify", "hidden")


class EncoderOutput(NamedTuple):
    """What the encoder's forward returns: the task's head output (task "mlm": (B, T, V) or
    (P, V) logits; "classify": (B, L) logits; "hidden": (B, T, C) states) and, with
    return_attention, one (B, H, T, T) probability tensor per layer (else None)."""

    logits: torch.Tensor
    attentions: list[torch.Tensor] | None = None


FAMILY = Family(
    name="encoder",
    description="an encoder-only model (BERT): bidirectional self-attention, a masked-LM head and, "
                "with labels, a classification head",
    tasks=(TaskSpec("fill-mask", needs="mlm_head"), TaskSpec("classify", needs="labels"), TaskSpec("attention"),
           TaskSpec("embeddings")),
    groups=(AttentionGroup("self", "tokens", "tokens", causal=False,
                           description="bidirectional self-attention: every token over every other"),),
    attention_kind="bidirectional",
    output=EncoderOutput,
    framing="cls_sep",
    features=("labels", "mlm_head"),
    builds=FAMILY_PARTS["encoder"],
    # masked-LM pretraining over the works, then the genre head
    training=TrainingSpec("train_encoder:EncoderObjective", tokenizer="corpus_specials"),
    lens=LensSpec("tokens", "blocks", "same", "the final norm and the masked-LM head"),
)


def padding_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """(B, T) 1/0 or bool real-token mask -> (B, 1, 1, T) boolean key mask for attention."""
    if attention_mask is None:
        return None
    return attention_mask.bool()[:, None, None, :]


class Encoder(Embeddings, nn.Module):
    family: ClassVar[Family] = FAMILY

    def __init__(self, config: ModelConfig):
        super().__init__()
        config.validate()
        self.config = config
        C, V = config.d_model, config.vocab_size
        self.init_embeddings(config)  # tok_emb, pos_emb | pos_table, emb_dropout
        self.emb_norm = nn.LayerNorm(C, eps=config.layer_norm_eps, bias=config.bias)
        self.blocks = nn.ModuleList(Block(config, causal=False) for _ in range(config.n_layers))
        self.ln_f = (
            nn.LayerNorm(C, eps=config.layer_norm_eps, bias=config.bias)
            if config.norm == "pre"
            else nn.Identity()
        )
        # masked-LM head (BERT's "transform" then a decoder tied to the token embedding)
        self.mlm_dense = Linear(C, C, bias=config.bias)
        self.mlm_norm = nn.LayerNorm(C, eps=config.layer_norm_eps, bias=config.bias)
        self.mlm_bias = nn.Parameter(torch.zeros(V))
        self.mlm_decoder: Linear | None = None if config.tie_embeddings else Linear(C, V, bias=False)
        # classification head on the pooled representation
        self.pooler: Linear | None = None
        self.classifier: Linear | None = None
        if config.labels:
            self.pooler = Linear(C, C, bias=config.bias)
            self.classifier = Linear(C, len(config.labels), bias=True)
        self.classifier_blocks = nn.ModuleList(Block(config, causal=False) for _ in range(config.classifier_layers))
        self.apply(Transformer._init_weights)
        name_hook_points(self)  # every HookPoint's name is its path: "blocks.2.attn.hook_z"

    # --- the stack -------------------------------------------------------------------
    def encode(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               return_attention: bool = False) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Hidden states (B, T, C) and, if asked, per-layer (B, H, T, T) attention maps.

        Rows of padded query positions in the maps are zero: they are not results.
        """
        self.check_length(ids.shape[1])
        x = self.embed(ids, norm=self.emb_norm)  # (B, T, C): LayerNorm(tokens + positions)
        x, attentions = self.run_blocks(x, self.blocks, attention_mask, return_attention)
        return self.ln_f(x), attentions

    def check_length(self, T: int) -> None:
        if T > self.config.context_length:
            raise ContextLengthError(f"sequence of {T} tokens exceeds the context length {self.config.context_length}")

    @staticmethod
    def run_blocks(x: torch.Tensor, blocks, attention_mask: torch.Tensor | None, return_attention: bool = False
                   ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """(B, T, C) through `blocks`, and their (B, H, T, T) maps if asked."""
        key_mask = padding_mask(attention_mask)  # (B, 1, 1, T) or None
        attentions: list[torch.Tensor] | None = [] if return_attention else None
        for block in blocks:
            x, probs, _ = block(x, mask=key_mask, return_attention=return_attention)
            if attentions is not None:  # return_attention
                if attention_mask is not None:  # padded query rows are not results
                    probs = probs * attention_mask.to(probs.dtype)[:, None, :, None]
                attentions.append(probs)
        return x, attentions

    def classifier_hidden(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T) -> (B, T, C): the states the classification head pools (through its own top
        blocks when it has them)."""
        k = len(self.classifier_blocks)
        if not k:
            return self.encode(ids, attention_mask)[0]
        self.check_length(ids.shape[1])
        x = self.embed(ids, norm=self.emb_norm)
        x, _ = self.run_blocks(x, self.blocks[: len(self.blocks) - k], attention_mask)
        x, _ = self.run_blocks(x, self.classifier_blocks, attention_mask)
        return self.ln_f(x)

    # --- heads -----------------------------------------------------------------------
    def mlm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., C) -> (..., V)"""
        h = self.mlm_norm(activate(self.mlm_dense(hidden), self.config.activation))
        weight = self.tok_emb.weight if self.mlm_decoder is None else self.mlm_decoder.weight
        return F.linear(h, weight, self.mlm_bias)

    def pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, C) -> (B, C): mean over real positions, or the first ([CLS]) position."""
        if self.config.pooling == "cls":
            return hidden[:, 0]
        if attention_mask is None:
            return hidden.mean(dim=1)
        w = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
        return (hidden * w).sum(dim=1) / w.sum(dim=1).clamp(min=1.0)

    def sentence_embeddings(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T) framed ids, right-padded, and their (B, T) 1/0 real-token mask -> (B, C) float32
        embeddings of unit length: the hidden states pooled as config.pooling says (the mean over
        real positions, [CLS] and [SEP] included, or the [CLS] position), then L2-normalised, as a
        sentence-transformers model's Pooling and Normalize modules do. Padding changes nothing."""
        hidden, _ = self.encode(ids, attention_mask)  # (B, T, C)
        pooled = self.pool(hidden.float(), attention_mask)  # (B, C), in float32 whatever the weights' dtype
        return F.normalize(pooled, p=2.0, dim=-1)  # (B, C), each row's norm 1

    def classify_logits(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.classifier is None or self.pooler is None:  # made together, from config.labels
            raise ValueError("this encoder has no classification head (config.labels is empty)")
        return self.classifier(torch.tanh(self.pooler(self.pool(hidden, attention_mask))))  # (B, L)

    def forward(
        self,
        ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        return_attention: bool = False,
        task: str = "mlm",
        positions: torch.Tensor | None = None,
    ) -> EncoderOutput:
        """An EncoderOutput: logits of the task's head, attentions or None.

        task "mlm": logits (B, T, V), or (P, V) for the P True cells of a boolean `positions`
        (B, T) (training scores only the masked positions); "classify": (B, L);
        "hidden": the states (B, T, C).
        """
        if task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {task!r}")
        if task == "classify" and len(self.classifier_blocks):  # the maps asked are the shared model's
            attentions = self.encode(ids, attention_mask, True)[1] if return_attention else None
            return EncoderOutput(self.classify_logits(self.classifier_hidden(ids, attention_mask), attention_mask),
                                 attentions)
        hidden, attentions = self.encode(ids, attention_mask, return_attention)
        if task == "mlm":
            logits = self.mlm_logits(hidden if positions is None else hidden[positions])
        elif task == "classify":
            logits = self.classify_logits(hidden, attention_mask)
        else:
            logits = hidden
        return EncoderOutput(logits, attentions)

    # --- the family contract (model/families/contract.py) --------------------------------
    @torch.inference_mode()
    def analyse(self, ids: list[int], target_ids: list[int] | None = None) -> AttentionAnalysis:
        """Every layer's and head's map of one sequence (ids as given: the caller frames a text
        as [CLS] text [SEP]): {"self": (L, H, T, T)}."""
        if target_ids is not None:
            raise ValueError("an encoder analyses one sequence: it takes no target")
        inputs = torch.tensor([ids], dtype=torch.long, device=self.device)
        attentions = self(inputs, return_attention=True, task="hidden").attentions
        return AttentionAnalysis({"tokens": list(ids)}, {"self": torch.stack([a[0] for a in attentions])})

    @torch.inference_mode()
    def run_sequence(self, tokens: dict[str, list[int]]) -> None:
        """One forward of an analysed sequence for its intermediates (model/analysis/attention_maps.py), to
        the cheapest output: the hidden states, no head."""
        self(torch.tensor([tokens["tokens"]], dtype=torch.long, device=self.device), task="hidden")

    def sequence(self, ids: list[int], target_ids: list[int] | None = None) -> tuple[dict[str, list[int]], bool]:
        if target_ids is not None:
            raise ValueError("an encoder reads one sequence: it takes no target")
        return {"tokens": list(ids)}, False

    def stream_logits(self, tokens: dict[str, list[int]]) -> torch.Tensor:
        """(T, V): the masked-LM head at every position (what the model predicts stands there)."""
        inputs = torch.tensor([tokens["tokens"]], dtype=torch.long, device=self.device)
        return self(inputs, task="mlm").logits[0]

    def unembed(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlm_logits(self.ln_f(x))
