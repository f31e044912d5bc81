"""attnlens: serve transformers, generate with them, and look inside their attention heads.

One import name for everything the project offers to Python. The repository keeps its
top-level folders; setuptools maps them under this package (pyproject.toml,
[tool.setuptools.package-dir]):

    attnlens.model   <- model/   the transformer: parts, families, tokenizer, checkpoints
    attnlens.app     <- app/     the HTTP service (FastAPI), its engine and CLI

Nothing is installed under a top-level name as common as `app` or `model`.
"""

__version__ = "0.1.0"
