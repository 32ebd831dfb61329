# `make demo` and `make test` work on a fresh machine: they make .venv, install a CPU torch
# (pinned here only, for this set-up path; the library itself takes any torch >= 2.4) and ficco.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[bench,test,cuda,rocm]'
	touch $@

.PHONY: install demo test test-gpu clean
install: $(BIN)/.installed

demo: install
	$(BIN)/python -m ficco demo

test: install
	$(BIN)/python -m pytest -q -rs --durations=15

test-gpu: install
	$(BIN)/python -m pytest -q -m gpu tests/gpu

clean:
	rm -rf $(VENV) .pytest_cache
