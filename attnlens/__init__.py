"""attnlens: serve transformers, generate with them, and look inside their attention heads.

One import name for everything the project offers to Python. The repository keeps its
top-level folders and this package holds relative links to them, so the import name is the path:

    attnlens/model  -> ../model   the transformer: parts, families, tokenizer, checkpoints
    attnlens/app    -> ../app     the HTTP service (FastAPI), its engine and CLI
    attnlens/static -> ../static  the browser page (also drawn inline by attnlens.show)

Nothing is installed under a top-level name as common as `app` or `model`.

What a base install (`pip install attnlens`: httpx and numpy) gives:

    attnlens.Client, attnlens.AsyncClient   the HTTP API, typed answers, errors as exceptions
    attnlens.show                           the page's views inline in Jupyter, offline

attnlens[model] adds attnlens.model and attnlens.local (run a checkpoint in this process),
attnlens[server] the server (`attnlens serve`, attnlens.Server), attnlens[train] the training.
"""

__version__ = "0.1.0"

# Loaded on first use (PEP 562), so the server's processes, which import attnlens.app and
# attnlens.model, never pay for httpx or the client.
_EXPORTS = {
    "ablation": ("Ablation", "format_ablation", "parse_ablation"),
    "answers": ("Attention", "AttentionGroup", "Classification", "Embeddings", "FillMask", "FillMaskCandidate",
                "GeneratedToken", "Generation", "GroupSpec", "HeadAtlas", "HeadExplanation", "HeadGroupScores",
                "LabelScore", "LensAnswer", "LogitAttributionAnswer", "LogitsAnswer", "LogitsEffect", "ModelSummary",
                "PatchAnswer", "PositionLogits", "RankedHead", "Recomputed", "ScorePair", "ScoreParts", "StreamDone",
                "Token", "TokenProb"),
    "client": ("AsyncClient", "Client", "TokenStream"),
    "errors": ("APIConnectionError", "APIError", "AttnlensError", "AuthenticationError", "BadRequestError",
               "InternalServerError", "NotFoundError", "PayloadTooLargeError", "RateLimitError", "RequestTimeoutError",
               "ServiceUnavailableError", "StreamError", "ValidationError"),
    "inline": ("InlineView", "show"),
    "serve": ("Server",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
# submodules reachable as attributes without their own import (attnlens.local.attention(...))
_SUBMODULES = {"ablation", "answers", "app", "bertviz", "bundle", "causes_html", "client", "codec", "errors", "inline",
               "local", "model", "resources", "serve"}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    from importlib import import_module

    if name in _SUBMODULES:
        return import_module(f".{name}", __name__)  # the import binds it here
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'attnlens' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
