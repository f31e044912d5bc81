"""Named intermediates (TransformerLens's hook names) and head ablation, for every family.

Shapes: B = batch, T = query positions of the call, S = key positions the queries see, C = d_model,
H = query heads, K = key/value heads, D = d_head.

Hook points are modules (`HookPoint`, as TransformerLens's hook_points.py): each part owns its own
(model/parts/block.py, attention.py: `self.hook_z = HookPoint()`), so every family and architecture
has them, and each knows its name, its path in the model (`name_hook_points`, when the model is
built): `[n for n, m in model.named_modules() if isinstance(m, HookPoint)]` lists them all.

    {stack}.{l}.hook_resid_pre        [B, T, C]     the block's input (the residual stream)
    {stack}.{l}.hook_resid_post       [B, T, C]     the block's output
    {stack}.{l}.hook_attn_out         [B, T, C]     self-attention's output (after its projection)
    {stack}.{l}.hook_cross_out        [B, T, C]     cross-attention's output (encoder-decoder only)
    {stack}.{l}.hook_mlp_out          [B, T, C]     the FFN's output
    {stack}.{l}.ffn.hook_router       [B, T, E]     a mixture of experts' router probabilities over its E
                                                    experts (Mixtral; an edit reroutes)
    {stack}.{l}.ffn.hook_experts      [B, T, k]     the k experts each token was routed to (int64)
    {stack}.{l}.{attn}.hook_q         [B, T, H, D]  queries, before rotary positions (after the
                                                    per-head q/k norm where config.qk_norm, as
                                                    are hook_k and the maps: Qwen3)
    {stack}.{l}.{attn}.hook_k / hook_v [B, S, K, D] keys / values the queries see (cache included;
                                                    K = H except with grouped-query attention); a
                                                    rotary model's hook_k is before rotation, of this
                                                    call's new positions only (S = T without a cache)
    {stack}.{l}.{attn}.hook_rot_q     [B, T, H, D]  queries after rotary positions (rotary models only)
    {stack}.{l}.{attn}.hook_rot_k     [B, S, K, D]  keys after rotary positions (rotary models only)
    {stack}.{l}.{attn}.hook_pattern   [B, H, T, S]  the probabilities (asking for it takes the
                                                    explicit path for that module)
    {stack}.{l}.{attn}.hook_z         [B, T, H, D]  each head's output before the output projection
                                                    (as computed: recorded before any ablation)

    stack: "blocks" (decoder, encoder), "encoder.blocks" / "decoder.blocks" (encoder-decoder)
    attn:  "attn" (self-attention), "cross_attn" (the encoder-decoder's cross-attention)

(and an encoder's "classifier_blocks.{l}": the classification head's own blocks). A point runs only
under active hooks: without them the parts never call it, and a call returns its input at once.

A family's attention group names the module its heads live in (AttentionGroup.hook, e.g.
"decoder.blocks.{layer}.cross_attn"); `ablation_targets` resolves (group, layer, head) through it.

    with hooked(model, Hooks(record={"blocks.0.hook_resid_post"}, ablate=[...])) as hooks:
        logits = model(ids).logits          # forward's return type never changes
    hooks.captured["blocks.0.hook_resid_post"]

Ablation edits hook_z before the output projection: "zero" sets a head's z to 0, "mean" to its
mean over the row's positions in the call that first sees the row (a prompt's prefill: the
engine keeps that mean per row, `row_means`, and reuses it at every decode step). Edits are per
row: `row_ablate` gives each row of a batch its own (an ablated generation shares its decode
batch with unablated ones). Unused, the hooks cost one context-variable read and a None check
per block and attention module, and no module call (bench/bench_explain.py measures the decode rate).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Literal

import torch
import torch.nn as nn

HOW = ("zero", "mean")

# where Hooks.progress is called: after a block's (self- or cross-) attention, and after the block
_PROGRESS_POINTS = ("hook_attn_out", "hook_cross_out", "hook_resid_post")

_active: contextvars.ContextVar["Hooks | None"] = contextvars.ContextVar("attnlens_hooks", default=None)


def active() -> "Hooks | None":
    """The hooks of the forward running in this context, or None (the common case)."""
    return _active.get()


# A long forward under a reporting call (Hooks.progress) also reports between pieces of its largest
# sub-layers (a long prompt's attention and FFN), so that a stream decoding beside it waits for
# one piece, not for a whole sub-layer (at 8k tokens about a second each on 2 cores).
PIECE_MACS = 1 << 30  # multiply-adds of one piece: ~20 ms at 2 cores' float32 rate


def row_pieces(rows: int, macs_before: Callable[[int], float]) -> list[tuple[int, int]] | None:
    """Row ranges [a, b) covering 0..rows, each about PIECE_MACS of work by `macs_before(t)` (the
    work of rows 0..t-1, increasing); None when the forward reports no progress or one piece does."""
    hooks = active()
    if hooks is None or hooks.progress is None or rows < 2:
        return None
    n = min(rows, math.ceil(macs_before(rows) / PIECE_MACS))
    if n <= 1:
        return None
    ends = []
    for i in range(1, n):  # the first t whose work reaches i / n of the whole
        goal, lo, hi = macs_before(rows) * i / n, 1, rows
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if macs_before(mid) < goal else (lo, mid)
        ends.append(lo)
    edges = sorted(set([0, *ends, rows]))
    return list(zip(edges[:-1], edges[1:]))


def piece_done() -> None:
    """Between two pieces of a sub-layer (row_pieces): the reporting call's progress point."""
    hooks = active()
    if hooks is not None and hooks.progress is not None:
        hooks.progress()


@dataclass(frozen=True)
class HeadAblation:
    """One head to ablate, as a request names it: group None = the family's first generating group."""

    layer: int
    head: int
    how: Literal["zero", "mean"] = "zero"
    group: str | None = None


@dataclass(frozen=True)
class ZEdit:
    """A resolved ablation: the attention module's hook name and the head."""

    module: str  # e.g. "blocks.2.attn"
    head: int
    how: str


class StopForward(Exception):
    """Raised by Hooks.keep at Hooks.stop_after: the forward has gone as far as it was asked to."""


class AblationError(ValueError):
    """An ablation names a group, layer, head or kind the model does not have."""


def default_group(family) -> str:
    """The group an ablation without `group` edits: the first a generation steps with, else the first."""
    return family.ablation_group


def ablation_targets(family, config, ablate: Iterable[HeadAblation], *, limit: int | None = None) -> tuple[ZEdit, ...]:
    """Check each ablation against a model's family declaration and config (group, layer, head, how;
    no repeats) and name its module."""
    ablate = list(ablate)
    if limit is not None and len(ablate) > limit:
        raise AblationError(f"at most {limit} ablations (got {len(ablate)})")
    names = [g.name for g in family.groups]
    out, seen = [], set()
    for i, a in enumerate(ablate):
        group = default_group(family) if a.group is None else a.group
        if group not in names:
            raise AblationError(f"ablation {i}: this model has no attention group {group!r}; it has {names}")
        if not 0 <= a.layer < config.n_layers:
            raise AblationError(f"ablation {i}: layer {a.layer} out of range 0..{config.n_layers - 1}")
        if not 0 <= a.head < config.n_heads:
            raise AblationError(f"ablation {i}: head {a.head} out of range 0..{config.n_heads - 1}")
        if a.how not in HOW:
            raise AblationError(f"ablation {i}: how must be one of {HOW}, got {a.how!r}")
        key = (group, a.layer, a.head)
        if key in seen:
            raise AblationError(f"ablation {i}: group {group!r} layer {a.layer} head {a.head} is named twice")
        seen.add(key)
        out.append(ZEdit(family.group(group).hook.format(layer=a.layer), a.head, a.how))
    return tuple(out)


@dataclass
class Hooks:
    """What one forward (or one generation's calls) records and edits.

    record: hook names to keep (a set), or a predicate on names; captured[name] holds each (the
    tensor as the forward made it: read it before the next call writes into a cache).
    ablate: edits for every row; row_ablate: each row's own (a batch of generations).
    row_means: per row, (module, head) -> (D,) mean z held from the first call (filled here).
    valid: each row's real positions when a call's rows are right-padded to max(valid).
    stop_after: a hook name at which the forward stops (StopForward is raised once that point is
    kept), as TransformerLens's stop_at_layer: the logit lens needs the residual streams, not the
    logits; `run_until` runs a forward that far.
    given: block outputs to use instead of running the block ("blocks.1.hook_resid_post" ->
    [B, T, C]), as TransformerLens's start_at_layer: an ablated run takes the clean run's outputs
    of the blocks before the first ablated one (`unchanged_outputs`), which it would only
    recompute bit for bit. A given block keeps nothing and returns no attention maps.
    progress: called after each attention and each block (_PROGRESS_POINTS), and between the pieces
    of a long prompt's attention and FFN (row_pieces): a long forward tells a watchdog it is
    working, and lets other work take a turn, every PIECE_MACS of work at most.
    """

    record: set[str] | Callable[[str], bool] = field(default_factory=set)
    ablate: tuple[ZEdit, ...] = ()
    row_ablate: list[tuple[ZEdit, ...]] | None = None
    row_means: list[dict] | None = None
    valid: list[int] | None = None
    stop_after: str | None = None
    given: dict[str, torch.Tensor] = field(default_factory=dict)
    captured: dict[str, torch.Tensor] = field(default_factory=dict)
    progress: Callable[[], None] | None = None  # called at each of _PROGRESS_POINTS: a long forward's heartbeat

    def __post_init__(self) -> None:
        if not callable(self.record):
            self.record = set(self.record)
        # hook point ("blocks.2.attn.hook_z") -> [(row or None for every row, head, how)]
        self._edits: dict[str, list[tuple[int | None, int, str]]] = {}
        for e in self.ablate:
            self._edits.setdefault(f"{e.module}.hook_z", []).append((None, e.head, e.how))
        for b, edits in enumerate(self.row_ablate or []):
            for e in edits:
                self._edits.setdefault(f"{e.module}.hook_z", []).append((b, e.head, e.how))

    @property
    def edits(self) -> bool:
        return bool(self._edits)

    def wants(self, name: str) -> bool:
        return self.record(name) if callable(self.record) else name in self.record

    def keep(self, name: str, tensor: torch.Tensor) -> None:
        if self.wants(name):
            self.captured[name] = tensor
        if self.progress is not None and name.endswith(_PROGRESS_POINTS):
            self.progress()
        if name == self.stop_after:
            raise StopForward(name)

    def point(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """What HookPoint `name` passes on: `tensor` kept as it came, then edited where an ablation
        says (a hook_z's heads); the tensor itself when nothing edits it."""
        self.keep(name, tensor)
        if name not in self._edits:
            return tensor
        return self.edit_z(name, tensor)

    def means_of(self, row: int) -> dict:
        if self.row_means is None:
            self.row_means = []
        while len(self.row_means) <= row:
            self.row_means.append({})
        return self.row_means[row]

    def edit_z(self, name: str, z: torch.Tensor) -> torch.Tensor:
        """z [B, T, H, D], each head's output at hook point `name`: the ablated heads' entries replaced."""
        edits = self._edits.get(name)
        if not edits:
            return z
        module = name.removesuffix(".hook_z")  # the held means' key names the attention module
        z = z.clone()
        B, T = z.shape[:2]
        # each row's real positions when z's rows are right-padded, else None
        valid = self.valid if self.valid is not None and len(self.valid) == B and T == max(self.valid) else None
        for row, head, how in edits:
            rows = range(B) if row is None else (row,)
            for b in rows:
                if b >= B:
                    continue
                if how == "zero":
                    z[b, :, head] = 0
                    continue
                held = self.means_of(b)
                key = (module, head)
                if key not in held:
                    n = valid[b] if valid is not None else T
                    held[key] = z[b, :n, head].mean(dim=0).detach().clone()  # (D,) over the row's positions
                z[b, :, head] = held[key]
        return z


class HookPoint(nn.Module):
    """An identity module at one named intermediate: called with a tensor under active hooks, it
    hands the tensor to them under its name (Hooks.point: kept, maybe edited) and returns what
    they give back; without hooks it returns its input. The parts call it only under hooks, so a
    forward without them makes no module call. No parameters: a model's state_dict is unchanged."""

    def __init__(self):
        super().__init__()
        self.name = ""  # its path in the model ("blocks.2.attn.hook_z"), set by name_hook_points

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hooks = _active.get()
        if hooks is None:
            return x
        return hooks.point(self.name, x)

    def extra_repr(self) -> str:
        return repr(self.name)


def name_hook_points(model: nn.Module) -> None:
    """Give every HookPoint its path in `model` as its name (once per model: the families do it
    when they build one, `hooked` for a part used alone). The paths are the hook names."""
    if getattr(model, "_hook_points_named", False):
        return
    for path, module in model.named_modules():
        if isinstance(module, HookPoint):
            module.name = path
    # nn.Module's __setattr__ is typed for tensors and modules only; a plain flag is fine there
    model._hook_points_named = True  # type: ignore[assignment]


def batch_hooks(row_ablate: list[tuple[ZEdit, ...]], row_means: list[dict], valid: list[int] | None = None,
                ) -> "Hooks | None":
    """The hooks of one batched step whose rows each have their own ablations (and held means);
    None when no row ablates anything (the step then costs nothing more)."""
    if not any(row_ablate):
        return None
    return Hooks(row_ablate=list(row_ablate), row_means=list(row_means), valid=valid)


@contextlib.contextmanager
def hooked(model: nn.Module, hooks: "Hooks | None") -> Iterator["Hooks | None"]:
    """Forwards of `model` in this block record and edit through `hooks` (None: a no-op)."""
    if hooks is None:
        yield None
        return
    name_hook_points(model)
    token = _active.set(hooks)
    try:
        yield hooks
    finally:
        _active.reset(token)


def run_until(model: nn.Module, hooks: Hooks, forward: Callable[[], object]) -> None:
    """Run `forward()` under `hooks` until it keeps hooks.stop_after; what it recorded on the way is
    in hooks.captured. An error if the forward ends without passing that point."""
    if hooks.stop_after is None:
        raise ValueError("run_until needs hooks.stop_after")
    with hooked(model, hooks):
        try:
            forward()
        except StopForward:
            return
    raise ValueError(f"the forward never reached {hooks.stop_after!r}")


def unchanged_outputs(captured: dict[str, torch.Tensor], ablate: Iterable[ZEdit]) -> dict[str, torch.Tensor]:
    """The block outputs ("*.hook_resid_post", recorded in the order the blocks ran) of a run without
    `ablate` that a run with it would compute identically: those of the blocks before the first
    block holding an ablated head. Hooks(given=...) then skips them."""
    ablated = {e.module.rsplit(".", 1)[0] for e in ablate}  # "decoder.blocks.1.cross_attn" -> "decoder.blocks.1"
    out = {}
    for name, tensor in captured.items():
        if not name.endswith(".hook_resid_post"):
            continue
        if name.removesuffix(".hook_resid_post") in ablated:
            break
        out[name] = tensor
    return out
