"""What the explain routes compute, on the model's side, for any family that declares a lens
(Family.lens, model/families/contract.py): per-position logits (with and without ablated heads),
the logit lens, and one head's attention step by step. Each returns plain numbers (lists, floats)
keyed by token id; the service adds the tokens' texts.

Shapes: T = positions of the lens stream (a decoder's or encoder's tokens, an encoder-decoder's
decoder inputs: start token + target), V = vocabulary, L = layers, H = heads, D = d_head.

    sequence_logits   the (T, V) logits of one forward, hooks applied (ablation, recording)
    position_logits   per position: top-k, the actual token's probability and log-probability
    logits_report     position_logits, and with ablations the clean run and per-position KL and
                      change in the actual token's log-probability
    lens_report       every block's residual stream (and the embeddings) through the final norm
                      and the head, at the positions asked for: top-k and the actual token's
                      probability (and its rank when asked)
    explain_head      one head's q, keys, values, scores, mask, softmax and z at one query

Each takes `progress`, called at the forward's progress points (model/hooks.py) and after each
block of the lens's unembedding: a long call's heartbeat for the engine's watchdog, where a call
whose caller went away stops, and where decode steps beside it take their turn.

"Actual" is what the position's logits predict (LensSpec.predicts): the next token of the stream
(none at the last position), or for a masked-LM head the token at the position itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, TypedDict

import torch

from attnlens.model.analysis import vocab_rows
from attnlens.model.families.contract import LensSpec, family_of
from attnlens.model.hooks import Hooks, ZEdit, hooked, run_until, unchanged_outputs


@dataclass
class Sequence:
    tokens: dict[str, list[int]]  # axis -> ids (a target starts with the decoder's start token)
    generated: bool  # the target is the model's own greedy output (computed without ablation)

    def stream(self, model) -> list[int]:
        return self.tokens[lens_of(model).stream]


Progress = Callable[[], None] | None  # a long call's report point (operations.py's `report`), or None


def lens_of(model) -> LensSpec:
    """The model's family's lens: every function here reads one (the explain routes serve only a
    family that declares it, app/serving/explain_serving.py)."""
    lens = family_of(model).lens
    assert lens is not None, f"the {family_of(model).name} family declares no lens"
    return lens


class PositionLogits(TypedDict):
    position: int
    top: list[tuple[int, float]]  # (id, probability), most likely first
    next: int | None  # the actual token
    next_prob: float | None
    next_logprob: float | None


class LogitsReport(TypedDict, total=False):
    """logits_report's answer (`clean` and `effect` only with an ablation)."""

    tokens: dict[str, list[int]]
    generated: bool
    stream: list[int]
    positions: list[PositionLogits]
    clean: list[PositionLogits]
    effect: list[dict]  # per position: kl, delta_logprob


class LensReport(TypedDict, total=False):
    """lens_report's answer, or only `error` (a position past the end of a generated target)."""

    error: str
    tokens: dict[str, list[int]]
    generated: bool
    stream: list[int]
    actual: list[int | None]
    positions: list[int]
    layers: list[dict]  # per row: index, top_ids, top_probs, rank, prob (and a mixture of experts' experts)


class HeadStep(TypedDict, total=False):
    """explain_head's answer, or only `error` (a query past the end of a generated target)."""

    error: str
    group: str
    layer: int
    head: int
    query: int
    query_id: int
    key_ids: list[int]
    d_head: int
    scale: float  # the attention module's own scale, what the forward multiplied q.k by
    softcap: float | None  # Gemma 2's cap: scaled = cap * tanh(scores * scale / cap); None without one
    kv_head: int
    q: list[float]
    keys: list[list[float]]
    values: list[list[float]]
    scores: list[float]
    scaled: list[float]
    mask: list[bool]
    masked: list[float | None]
    softmax: list[float]
    pattern_row: list[float]
    z: list[float]
    z_model: list[float]
    tokens: dict[str, list[int]]
    generated: bool


def actual_ids(model, stream: list[int]) -> list[int | None]:
    """What each position's logits predict: the next id (None at the end), or the id itself."""
    if lens_of(model).predicts == "same":
        return list(stream)
    return [*stream[1:], None]


def sequence_of(model, ids: list[int], target_ids: list[int] | None) -> Sequence:
    tokens, generated = model.sequence(ids, target_ids)  # a greedy target is the clean model's
    return Sequence(tokens, generated)


def sequence_logits(model, seq: Sequence, hooks: Hooks | None) -> torch.Tensor:
    """(T, V) float32 logits of one forward of `seq` under `hooks`."""
    with hooked(model, hooks):
        return model.stream_logits(seq.tokens).float()


def _top(probs: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    values, ids = vocab_rows.top_k(probs, k)
    return ids.tolist(), values.tolist()


def position_logits(logprobs: torch.Tensor, actual: list[int | None], positions: list[int], top_k: int
                    ) -> list[PositionLogits]:
    """Per position of (P, V) log-probabilities (rows: `positions`): top-k ids and probabilities, the
    actual token's probability and log-probability."""
    ids, probs = _top(logprobs, top_k)
    out: list[PositionLogits] = []
    for i, p in enumerate(positions):
        a = actual[p]
        lp = None if a is None else float(logprobs[i, a])
        out.append({"position": p, "top": [(t, math.exp(v)) for t, v in zip(ids[i], probs[i])], "next": a,
                    "next_prob": None if lp is None else math.exp(lp), "next_logprob": lp})
    return out


@torch.inference_mode()
def logits_report(model, ids: list[int], target_ids: list[int] | None, ablate: tuple[ZEdit, ...], top_k: int,
                  last_only: bool, progress: Progress = None) -> LogitsReport:
    seq = sequence_of(model, ids, target_ids)
    stream = seq.stream(model)
    actual = actual_ids(model, stream)
    positions = [len(stream) - 1] if last_only else list(range(len(stream)))
    # with an ablation, the clean run keeps its block outputs: the ablated run starts from those
    # of the blocks before the first ablated head (unchanged_outputs), instead of recomputing them
    keep: set[str] | Callable[[str], bool] = (lambda name: name.endswith(".hook_resid_post")) if ablate else set()
    outputs = Hooks(record=keep, progress=progress) if ablate or progress is not None else None
    clean = torch.log_softmax(sequence_logits(model, seq, outputs)[positions], dim=-1)  # (P, V)
    report: LogitsReport = {"tokens": seq.tokens, "generated": seq.generated, "stream": stream}
    if not ablate:
        report["positions"] = position_logits(clean, actual, positions, top_k)
        return report
    assert outputs is not None  # made above for an ablation
    given = unchanged_outputs(outputs.captured, ablate)
    edited = torch.log_softmax(sequence_logits(model, seq, Hooks(ablate=ablate, given=given, progress=progress))
                               [positions], dim=-1)
    report["positions"] = position_logits(edited, actual, positions, top_k)
    report["clean"] = position_logits(clean, actual, positions, top_k)
    kl = (clean.exp() * (clean - edited)).sum(dim=-1).clamp_min(0).tolist()  # KL(clean || ablated)
    report["effect"] = [
        {"position": p, "kl": kl[i],
         "delta_logprob": None if actual[p] is None else float(edited[i, actual[p]] - clean[i, actual[p]])}
        for i, p in enumerate(positions)]
    return report


def lens_names(model) -> list[str]:
    """The residual stream points the lens reads: block 0's input, then every block's output."""
    stack = lens_of(model).stack
    L = model.config.n_layers
    return [f"{stack}.0.hook_resid_pre"] + [f"{stack}.{l}.hook_resid_post" for l in range(L)]


@torch.inference_mode()
def lens_report(model, ids: list[int], target_ids: list[int] | None, ablate: tuple[ZEdit, ...], top_k: int,
                positions: list[int] | None = None, rank: bool = False, progress: Progress = None) -> LensReport:
    """Rows: the embeddings (index -1), then after every block. Per row, at each of `positions`
    (default: every position of the stream, T; else positions in 0..T-1, in the order given):
    `top_ids` and `top_probs` (P, k), the actual token's (report["actual"], per position) `prob`
    (P,) and, with `rank`, its `rank` (0 = the most likely); None where there is no actual token
    (a rank not asked for is None too). Only the positions asked for are unembedded: the cost is
    (L + 1) * P rows through the (V, C) head."""
    seq = sequence_of(model, ids, target_ids)
    stream = seq.stream(model)
    actual = actual_ids(model, stream)
    names = lens_names(model)
    # a mixture of experts (Mixtral): the experts each block routed each position to, and their weights
    routes = [f"{lens_of(model).stack}.{l}.ffn.{p}" for l in range(model.config.n_layers)
              for p in ("hook_experts", "hook_router")] if getattr(model.config, "n_experts", 0) else []
    # the forward stops at the last block's output: the model's own logits are that through unembed
    hooks = Hooks(record=set(names) | set(routes), ablate=ablate, stop_after=names[-1], progress=progress)
    run_until(model, hooks, lambda: model.stream_logits(seq.tokens))
    at = list(range(len(stream))) if positions is None else list(positions)
    if at and max(at) >= len(stream):  # only a generated target's length is not known before this call
        return {"error": f"positions {max(at)} out of range: the {lens_of(model).stream} have "
                         f"{len(stream)} positions (0..{len(stream) - 1})"}
    actual_at = [actual[p] for p in at]
    P = len(at)
    device = hooks.captured[names[0]].device
    index = torch.tensor(at, dtype=torch.long, device=device)
    residuals = torch.cat([hooks.captured[name][0].index_select(0, index) for name in names])  # ((L + 1) * P, C)
    picks = torch.tensor([0 if a is None else a for a in actual_at], dtype=torch.long, device=device)[:, None]
    picks = picks.repeat(len(names), 1)  # ((L + 1) * P, 1)
    stats = vocab_rows.unembedded_stats(model.unembed, residuals, picks, model.config.vocab_size, top_k, rank,
                                        progress=progress)
    top_ids, top_probs = stats.top_ids.tolist(), stats.top_logprobs.exp().tolist()
    probs = stats.picked_logprob.exp().tolist()
    # picked_rank is made when rank is asked for
    ranks = stats.picked_rank.tolist() if stats.picked_rank is not None else [None] * len(probs)
    layers = []
    for row in range(len(names)):  # the embeddings, then each block's output
        rows = slice(row * P, (row + 1) * P)
        layers.append({"index": row - 1, "top_ids": top_ids[rows], "top_probs": top_probs[rows],
                       "rank": [None if a is None else r for a, r in zip(actual_at, ranks[rows])],
                       "prob": [None if a is None else p for a, p in zip(actual_at, probs[rows])]})
        if routes and row > 0:  # block row - 1's experts at each position: [(expert, weight), ...], heaviest first
            prefix = f"{lens_of(model).stack}.{row - 1}.ffn."
            chosen = hooks.captured[prefix + "hook_experts"][0].index_select(0, index)  # (P, k)
            weights = hooks.captured[prefix + "hook_router"][0].index_select(0, index).gather(-1, chosen)  # (P, k)
            weights = weights / weights.sum(-1, keepdim=True)
            layers[-1]["experts"] = [list(zip(e, w)) for e, w in zip(chosen.tolist(), weights.tolist())]
    return {"tokens": seq.tokens, "generated": seq.generated, "stream": stream, "actual": actual_at,
            "positions": at, "layers": layers}


def head_mask(model, group, query: int, n_keys: int, layer: int = 0) -> list[bool]:
    """Which keys query `query` may attend to in one unpadded sequence: causality and the layer's
    sliding window."""
    if not group.causal:
        return [True] * n_keys
    window = model.config.window_of(layer)  # a decoder's (Mistral, Gemma's sliding layers); None elsewhere
    return [k <= query and (window is None or k > query - window) for k in range(n_keys)]


def positions_note(config) -> str:
    """How positions enter the computation, for people."""
    if config.positional == "rotary":
        part = "" if config.rotary_pct == 1.0 else f" (the first {config.rotary_dims} of {config.d_head} dims)"
        return (f"rotary: q and k are rotated by angles of their positions{part} before q.k; the q and keys "
                "shown are the rotated ones; the embeddings carry no positions")
    if config.positional == "sinusoidal":
        return ("sinusoidal: a fixed sin/cos table is added to the token embeddings; q and k carry positions only "
                "through that")
    return ("learned: a learned position embedding is added to the token embeddings; q and k carry positions only "
            "through that")


@torch.inference_mode()
def explain_head(model, ids: list[int], target_ids: list[int] | None, group_name: str, layer: int, head: int,
                 query: int, ablate: tuple[ZEdit, ...], progress: Progress = None) -> HeadStep:
    """One head's attention at one query, recomputed from its q, keys and values, beside the map's row
    and the head's z as the forward made them (z before any ablation of this head)."""
    family = family_of(model)
    group = family.group(group_name)
    seq = sequence_of(model, ids, target_ids)
    n_queries = len(seq.tokens[group.queries])
    if not 0 <= query < n_queries:  # only a generated target's length is not known before this call
        return {"error": f"query {query} out of range: the {group.queries} have {n_queries} positions "
                         f"(0..{n_queries - 1})"}
    module = group.hook.format(layer=layer)
    rotary = model.config.positional == "rotary" and not group.is_cross
    qn, kn = ("hook_rot_q", "hook_rot_k") if rotary else ("hook_q", "hook_k")
    names = {f"{module}.{n}" for n in (qn, kn, "hook_v", "hook_pattern", "hook_z")}
    hooks = Hooks(record=names, ablate=ablate, progress=progress)
    sequence_logits(model, seq, hooks)
    got = {n.rsplit(".", 1)[1]: hooks.captured[n][0] for n in names}  # batch row 0
    H, K = model.config.n_heads, model.config.kv_heads
    kv = head // (H // K)  # grouped-query attention: the key/value head this query head reads
    q = got[qn][query, head].double()  # (D,)
    keys = got[kn][:, kv].double()  # (S, D)
    values = got["hook_v"][:, kv].double()  # (S, D)
    D = q.shape[0]
    scale = model.get_submodule(module).scale  # what the forward multiplied q.k by (its path is its hook name)
    scores = keys @ q  # (S,)
    scaled = scores * scale
    cap = model.get_submodule(module).softcap
    if cap is not None:  # Gemma 2: the scores soft-capped before the mask, as the forward caps them
        scaled = torch.tanh(scaled / cap) * cap
    mask = head_mask(model, group, query, keys.shape[0], layer)
    allowed = torch.tensor(mask)
    softmax = torch.softmax(scaled.masked_fill(~allowed, float("-inf")), dim=-1)
    z = softmax @ values  # (D,)
    queries_axis, keys_axis = seq.tokens[group.queries], seq.tokens[group.keys]
    return {
        "group": group.name, "layer": layer, "head": head, "query": query,
        "query_id": queries_axis[query], "key_ids": keys_axis,
        "d_head": D, "scale": scale, "softcap": cap, "kv_head": kv,
        "q": q.tolist(), "keys": keys.tolist(), "values": values.tolist(),
        "scores": scores.tolist(), "scaled": scaled.tolist(), "mask": mask,
        "masked": [s if m else None for s, m in zip(scaled.tolist(), mask)],
        "softmax": softmax.tolist(),
        "pattern_row": got["hook_pattern"][head, query].double().tolist(),
        "z": z.tolist(), "z_model": got["hook_z"][query, head].double().tolist(),
        "tokens": seq.tokens, "generated": seq.generated,
    }
