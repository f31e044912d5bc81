"""An attention answer as bertviz's head_view / model_view take it (Attention.to_bertviz).

bertviz wants one torch tensor per layer, [batch=1, heads, rows, cols], and picks layers and heads
by position in that list (`attention[i]`, `tensor[heads]`), showing `include_layers` /
`include_heads` as their labels. So an answer holding a subset (layers [1, 3] of 4, heads [0, 2]
of 8) gives a list of all 4 layers with every head (zeros where it holds nothing), and includes
exactly the held ones: bertviz then indexes the right tensors and labels them 1, 3 and 0, 2.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence

import numpy as np


class _Group(Protocol):
    """What of an answer's AttentionGroup (answers.py) is read here."""

    @property
    def maps(self) -> np.ndarray: ...  # (layers held, heads held, rows, cols)

    @property
    def queries(self) -> str: ...

    @property
    def keys(self) -> str: ...


class _Answer(Protocol):
    """What of an Attention answer (answers.py) is read here: declared, so this module needs no
    import of answers.py, which imports it."""

    @property
    def n_layers(self) -> int: ...

    @property
    def n_heads(self) -> int: ...

    @property
    def layers(self) -> Sequence[int]: ...

    @property
    def heads(self) -> Sequence[int]: ...

    @property
    def groups(self) -> Mapping[str, Any]: ...

    @property
    def tokens(self) -> Sequence[Any]: ...

    @property
    def target_tokens(self) -> Sequence[Any] | None: ...

    def axes(self) -> Any: ...


VIEWS = ("head", "model")


def _per_layer(answer: _Answer, group: _Group) -> list:
    """[n_layers] tensors of [1, n_heads, rows, cols]: the held maps in place, zeros elsewhere."""
    import torch

    L, H = answer.n_layers, answer.n_heads
    rows, cols = group.maps.shape[-2:]
    full = np.zeros((L, H, rows, cols), dtype=np.float32)
    full[np.ix_(answer.layers, answer.heads)] = group.maps
    return [torch.from_numpy(full[l : l + 1]) for l in range(L)]  # each (1, H, rows, cols)


def _texts(tokens) -> list[str]:
    return [t.text for t in tokens]


def bertviz_arguments(answer: _Answer, view: str = "head") -> dict[str, Any]:
    """The keyword arguments of bertviz.head_view (view="head") or model_view (view="model")."""
    if view not in VIEWS:
        raise ValueError(f"view must be one of {VIEWS} (bertviz's head_view and model_view), not {view!r}")
    if "target" in answer.axes():  # bertviz's encoder-decoder arguments, found by the groups' axes
        by_axes = {(g.queries, g.keys): g for g in answer.groups.values()}
        args: dict[str, Any] = {
            "encoder_attention": _per_layer(answer, by_axes["source", "source"]),
            "decoder_attention": _per_layer(answer, by_axes["target", "target"]),
            "cross_attention": _per_layer(answer, by_axes["target", "source"]),
            "encoder_tokens": _texts(answer.tokens),
            "decoder_tokens": _texts(answer.target_tokens),
        }
    else:
        group = next(iter(answer.groups.values()))
        args = {"attention": _per_layer(answer, group), "tokens": _texts(answer.tokens)}
    args["include_layers"] = list(answer.layers)
    if view == "model":
        args["include_heads"] = list(answer.heads)
    elif len(answer.heads) < answer.n_heads:
        args["heads"] = list(answer.heads)  # head_view: the heads shown at first (it lists every head)
    return args
