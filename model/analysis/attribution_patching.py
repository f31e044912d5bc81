"""Attribution patching (Nanda 2023): activation patching's first-order estimate, for every cell at
once from one forward of the clean and corrupted prompts as a batch and one backward.

    patched metric of a cell  ~  corrupted metric + sum over its positions and dims of
                                 (clean - corrupted activation) * d metric / d activation

the gradient taken in the corrupted run (TransformerLens's attribution_patch: the denoising form).
Values are on the exact values' scale (patching.py: the estimated patched metric, raw), for the
components heads [L][H], heads_by_position [L][T][H], residual [L][T] and layers
{"attention", "mlp": [L][T]}; paths are patched exactly only.

Autograd runs inside the call whatever the caller's mode (the engine runs operations under
torch.inference_mode): the corrupted run enables it, and block_runs gives its products plain
tensors, never inference tensors (which autograd cannot save). Its report points return to the
caller's mode while they last (`in_callers_mode`): the engine's other work runs there.
"""

from __future__ import annotations

from typing import Any

import torch

from attnlens.model.analysis.block_runs import (
    Recorder,
    Report,
    check_decoder,
    metric,
    readout,
    run_rows,
    span,
)
from attnlens.model.analysis.patching import PatchResult, check_patch, pair_of

WANT = {"heads": {"z"}, "heads_by_position": {"z"}, "residual": {"resid_pre"}, "layers": {"attn_out", "mlp_out"}}


def _no_report() -> None:
    pass


def _run_pair(model, ids: torch.Tensor, want: set[str], report: Report) -> tuple[Recorder, torch.Tensor]:
    """One forward of the pair ids (2, N), clean row 0 and corrupted row 1, keeping `want` per layer:
    the recorder and the final stream (2, N, C). With autograd on, the graph starts at the corrupted
    row's stream, not at the embedding's weights: one pass over the weights serves both runs."""
    runs = Recorder(want)
    with torch.no_grad():
        x = model.embed(ids)  # (2, N, C)
    if torch.is_grad_enabled():
        x = torch.cat([x[:1], x[1:].clone().requires_grad_()])
    final = run_rows(model, span(model, 0, ids.shape[1]), [0, 0], lambda layer, n: x, runs, report, last_only=False)
    return runs, final


def in_callers_mode(report: Report) -> Report:
    """report() run in the autograd mode of the caller (as it is now). Grad and inference modes are the
    thread's: the engine's core runs its decode steps on this very thread at a report point (the call
    runs on a greenlet that pauses there), and they must not run in this call's autograd."""
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def outside() -> None:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            report()
    return outside


def gradients(model, pair: torch.Tensor, want: set[str], answer_id: int, foil_id: int, report: Report
              ) -> tuple[dict[str, list[torch.Tensor]], dict[str, list[torch.Tensor]], list[float]]:
    """The pair's (2, N) activations, d metric / d activation in the corrupted run, [name] -> per layer
    (2, N, ...) and (N, ...), and both runs' metrics: one forward of the pair and one backward, with
    autograd on inside any inference mode."""
    L = model.config.n_layers
    paused = in_callers_mode(report)
    with torch.inference_mode(False), torch.enable_grad():
        direction = readout(model, answer_id, foil_id)  # plain tensors, made here
        runs, final = _run_pair(model, pair.clone(), want, paused)
        values = metric(model, final[:, -1], direction)  # (2,)
        names = [(name, layer) for name in sorted(want) for layer in range(L)]
        grads = torch.autograd.grad(values[1], [runs.got[name][layer] for name, layer in names], allow_unused=True)
    report()
    acts: dict[str, list[torch.Tensor]] = {name: [] for name in want}
    slopes: dict[str, list[torch.Tensor]] = {name: [] for name in want}
    for (name, layer), g in zip(names, grads):
        a = runs.got[name][layer].detach()
        acts[name].append(a)
        slopes[name].append(torch.zeros_like(a[1]) if g is None else g[1])
    return acts, slopes, values.detach().tolist()


def attribution_patch(model, clean_ids: list[int], corrupted_ids: list[int], answer_id: int, foil_id: int,
                      position: int | None = None, component: str = "heads", report: Report = _no_report
                      ) -> PatchResult:
    """Every cell's estimated patched metric (module docstring)."""
    check_decoder(model, "attribution patching")
    check_patch(model.config, clean_ids, corrupted_ids, answer_id, foil_id, position, component, "attribution", None)
    with torch.inference_mode():
        pair = pair_of(model, clean_ids, corrupted_ids, answer_id, foil_id, position)
    want = WANT[component]
    both = torch.cat([pair.clean, pair.corrupted])  # (2, N)
    acts, slopes, (clean_metric, corrupted_metric) = gradients(model, both, want, answer_id, foil_id, report)
    L, T = model.config.n_layers, pair.length
    effects = {name: [((acts[name][layer][0] - acts[name][layer][1]) * slopes[name][layer]).float()
                      for layer in range(L)] for name in want}  # per layer (N, ...)

    def per_position(name: str) -> list[list[Any]]:
        """[L][T] (z: [L][T][H]) corrupted metric + effect summed over the feature dims; positions past
        the metric's change nothing."""
        out = []
        for e in effects[name]:
            e = e.sum(dim=-1)  # (N,) or (N, H)
            rows = (corrupted_metric + e).tolist()
            pad = [corrupted_metric] * e.shape[1] if e.dim() == 2 else corrupted_metric
            out.append(rows + [list(pad) if isinstance(pad, list) else pad for _ in range(T - len(rows))])
        return out

    values: Any
    if component == "heads":
        values = [(corrupted_metric + e.sum(dim=(0, 2))).tolist() for e in effects["z"]]  # (N, H, D) -> (H,)
    elif component == "heads_by_position":
        values = per_position("z")
    elif component == "residual":
        values = per_position("resid_pre")
    else:
        values = {"attention": per_position("attn_out"), "mlp": per_position("mlp_out")}
    return PatchResult(component, "attribution", pair.position, pair.differs, clean_metric, corrupted_metric, values)
