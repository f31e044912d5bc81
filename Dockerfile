# attnlens: the service and its bundled model.
#   docker build -t attnlens .
#   docker run --gpus all -p 8000:8000 attnlens      # or without --gpus: runs on CPU
# torch from PyPI is the CUDA build on linux/x86_64 and bundles the CUDA runtime, so the
# host needs only the NVIDIA driver. ATTNLENS_DEVICE=auto picks CUDA when it is there.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /srv/attnlens

# 1. torch on its own layer (the big one), pinned as the Makefile pins it.
ARG TORCH_VERSION=2.13.0
RUN pip install "torch==${TORCH_VERSION}"

# 2. the project, installed from its pyproject exactly as CI does (`pip install .`).
COPY pyproject.toml setup.py README.md ./
COPY attnlens ./attnlens
COPY model ./model
COPY app ./app
RUN pip install .

# 3. the data the installed package serves: the web page and the bundled models.
COPY static ./static
COPY checkpoints/default ./checkpoints/default
COPY checkpoints/encoder ./checkpoints/encoder
COPY checkpoints/translator ./checkpoints/translator

RUN useradd --create-home --uid 10001 attnlens
USER attnlens

ENV ATTNLENS_HOST=0.0.0.0 \
    ATTNLENS_PORT=8000 \
    ATTNLENS_MODEL=/srv/attnlens/checkpoints/default \
    ATTNLENS_MODELS=/srv/attnlens/checkpoints/default,/srv/attnlens/checkpoints/encoder,/srv/attnlens/checkpoints/translator \
    ATTNLENS_STATIC_DIR=/srv/attnlens/static
EXPOSE 8000

# Ready = model loaded and warmed up (slim has no curl: ask Python).
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; port = os.environ.get('ATTNLENS_PORT', '8000'); sys.exit(0 if urllib.request.urlopen(f'http://127.0.0.1:{port}/readyz', timeout=4).status == 200 else 1)"]

CMD ["attnlens", "serve"]
