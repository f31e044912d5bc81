"""A request's `ablate` field: checked against the model (400 naming `ablate`), resolved to
model/hooks.py's ZEdits, and echoed back with each group filled in."""

from __future__ import annotations

from attnlens.app.api.common_schemas import Ablation
from attnlens.app.server.api_errors import ApiError
from attnlens.model.hooks import AblationError, HeadAblation, ablation_targets, default_group

NOTHING_ABLATED: tuple[tuple, None] = ((), None)  # (no edits, no echo): a request without `ablate`


def resolve_ablate(served, ablate: list[Ablation] | None, settings) -> tuple[tuple, list[Ablation] | None]:
    """(the edits the model applies, the echo) of a request's ablations; ((), None) without any."""
    if ablate is None:
        return NOTHING_ABLATED
    family = served.family
    try:
        edits = ablation_targets(family, served.checkpoint.config,
                                 [HeadAblation(a.layer, a.head, a.how, a.group) for a in ablate],
                                 limit=settings.max_ablations)
    except AblationError as e:
        hint = " (ATTNLENS_MAX_ABLATIONS)" if len(ablate) > settings.max_ablations else ""
        raise ApiError(400, f"{e}{hint}", param="ablate", code="invalid_ablation") from None
    echo = [a.model_copy(update={"group": a.group or default_group(family)}) for a in ablate]
    return edits, echo
