# `make demo` and `make test` work on a fresh machine: they make .venv, install a CPU torch
# (pinned here only, for this set-up path; the library itself takes any torch >= 2.4) and ficco.
# demo installs only what the CPU demo runs; test adds pytest, the bench extra and the GPU
# bindings whose calls the CPU-side backend tests check against their real signatures,
# Triton, whose interpreter runs the gated GEMM on CPU (tests/test_kernels.py, test_gated.py),
# and the linter and type checker `make lint` runs (pinned: a new release may find new things).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
# e.g. TORCH_INDEX=<PyTorch's CPU wheel index> for a CPU-only torch where the default is CUDA's
TORCH_INDEX ?=
LINTERS ?= ruff==0.17.5 mypy==2.4.1

$(BIN)/.demo-installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(BIN)/pip install -q -e .
	touch $@

$(BIN)/.test-installed: $(BIN)/.demo-installed Makefile
	$(BIN)/pip install -q -e '.[bench,test,triton,cuda13]' 'hip-python==10.*' $(LINTERS)
	touch $@

.PHONY: install demo test lint test-gpu clean
install: $(BIN)/.test-installed

demo: $(BIN)/.demo-installed
	$(BIN)/python -m ficco demo

test: $(BIN)/.test-installed
	$(BIN)/python -m pytest -q -rs --durations=15

# ruff over everything Python in the repository, mypy over the package (the settings of both
# in pyproject.toml)
lint: $(BIN)/.test-installed
	$(BIN)/ruff check .
	$(BIN)/mypy

test-gpu: $(BIN)/.test-installed
	$(BIN)/python -m pytest -q -m gpu tests/gpu tests/test_kernels.py tests/test_gated.py

clean:
	rm -rf $(VENV) .pytest_cache
