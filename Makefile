# `make demo`, `make test` and `make lint` work on a fresh machine: they make .venv, install a CPU
# torch (pinned here only, for this set-up path; the library itself takes torch >= 2.11) and
# ficco, then what each needs and nothing more:
# - demo: nothing else (the CPU demo runs on torch alone).
# - test: pytest; the bench extra; the GPU bindings whose calls the CPU-side backend tests check
#   against their real signatures; Triton, whose interpreter runs the gated GEMM on CPU
#   (tests/engine/test_kernels.py, test_gated.py) and whose import torchtitan's model code needs; and
#   torchtitan (tests/faces/test_torchtitan.py) without its trainer's dependencies (datasets, wandb,
#   tensorboard, ...: ~60 packages the test never imports), plus the few its model and config
#   code imports; transformers and megatron-core (tests/test_integrations_*.py): transformers
#   with its own dependencies (tokenizers, safetensors, huggingface-hub, ...: what its model
#   loading imports) and accelerate (its from_pretrained needs it for a tensor-parallel load);
#   megatron-core needs nothing beyond torch, numpy and packaging (no Transformer Engine, no
#   apex: the tests use its local layer spec).
# - lint: ruff and mypy (pinned: a new release may find new things).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
# e.g. TORCH_INDEX=<PyTorch's CPU wheel index> for a CPU-only torch where the default is CUDA's
TORCH_INDEX ?=
LINTERS ?= ruff==0.17.5 mypy==2.4.1
# the release ficco.torchtitan is tested with (ficco.torchtitan.TESTED_TORCHTITAN, pyproject's
# torchtitan extra); torchtitan needs Python >= 3.11
TORCHTITAN ?= torchtitan==0.3.0
TORCHTITAN_IMPORTS ?= tyro spmd_types==0.2.3
# the releases ficco.integrations is tested with (ficco.integrations.CLIENTS, pyproject's
# transformers and megatron extras); transformers 5.24 needs Python >= 3.11
TRANSFORMERS ?= transformers==5.24.0 accelerate==1.15.0
MEGATRON ?= megatron-core==0.16.1
# The other end of the supported torch range: the GPU machines' torch 2.11 (PyPI's wheel, a
# CUDA build, with its Triton 3.6), in a venv of its own, on the tests that touch what changed
# between torch releases (custom ops and compile, fp8, async TP, the parallel styles; the
# styles' W = 4 compiled case, 90 s, left out)
TORCH_OLDEST ?= torch==2.11.0
OLDEST_VENV ?= .venv-oldest
OLDEST_TESTS ?= tests/ops/test_custom_ops.py tests/ops/test_fp8.py tests/faces/test_compat_scaled.py \
	tests/faces/test_async_tp.py tests/faces/test_parallel.py \
	--deselect 'tests/faces/test_parallel.py::test_torch_plan_on_ficco_styles_compiled_fullgraph[4]'

# The GPU machines' image, for the lease's rehearsal on CPU (`make rehearse-lease-image`):
# Python 3.12, PyPI's torch 2.11.0 (a CUDA build of several GB, with its Triton 3.6),
# cuda-bindings 13, pytest and pytest-timeout; no hip-python. Not in CI (the download).
IMAGE_PY ?= python3.12
IMAGE_VENV ?= .venv-image
IMAGE_PACKAGES ?= torch==2.11.0 'cuda-bindings==13.*' numpy pytest pytest-timeout

$(BIN)/.demo-installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(BIN)/pip install -q -e .
	touch $@

$(BIN)/.test-installed: $(BIN)/.demo-installed Makefile
	$(BIN)/pip install -q -e '.[bench,test,triton,cuda13]' 'hip-python==10.*'
	if $(BIN)/python -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then \
	  $(BIN)/pip install -q --no-deps $(TORCHTITAN) && \
	  $(BIN)/pip install -q $(TORCHTITAN_IMPORTS) $(TRANSFORMERS); \
	else echo "torchtitan and transformers need Python >= 3.11: tests/faces/test_torchtitan.py and" \
	  "tests/faces/test_integrations_transformers.py will skip"; fi
	$(BIN)/pip install -q $(MEGATRON)
	touch $@

$(BIN)/.lint-installed: $(BIN)/.demo-installed Makefile
	$(BIN)/pip install -q $(LINTERS)
	touch $@

$(OLDEST_VENV)/bin/.installed: pyproject.toml Makefile
	$(PY) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/pip install -q $(TORCH_OLDEST)
	$(OLDEST_VENV)/bin/pip install -q -e '.[test]'
	touch $@

$(IMAGE_VENV)/bin/.installed: Makefile
	$(IMAGE_PY) -m venv $(IMAGE_VENV)
	$(IMAGE_VENV)/bin/pip install -q --upgrade pip
	$(IMAGE_VENV)/bin/pip install -q $(IMAGE_PACKAGES)
	touch $@

.PHONY: install demo test test-oldest-torch lint test-gpu rehearse-lease-image clean
install: $(BIN)/.test-installed

demo: $(BIN)/.demo-installed
	$(BIN)/python -m ficco demo

# two workers, each test file on one of them (its rank pools reused across its cases); TEST_WORKERS=0
# runs the suite in this process alone
TEST_WORKERS ?= 2
test: $(BIN)/.test-installed
	$(BIN)/python -m pytest -q -rs --durations=15 $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test-oldest-torch: $(OLDEST_VENV)/bin/.installed
	$(OLDEST_VENV)/bin/python -m pytest -q -rs $(OLDEST_TESTS)

# ruff over everything Python in the repository, mypy over the package (the settings of both
# in pyproject.toml)
lint: $(BIN)/.lint-installed
	$(BIN)/ruff check .
	$(BIN)/mypy

test-gpu: $(BIN)/.test-installed
	$(BIN)/python -m pytest -q -m gpu tests/gpu tests/engine/test_kernels.py tests/ops/all_gather_matmul/test_gated.py

# bench/gpu_lease.sh end to end on the fake GPU (tests/claims/test_gpu_lease.py's rehearsal) with the
# GPU image's versions; then the kernel tests' GPU cases must be collected under its Triton
rehearse-lease-image: $(IMAGE_VENV)/bin/.installed
	$(IMAGE_VENV)/bin/python -c 'import sys, torch, triton; print("image:", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)'
	$(IMAGE_VENV)/bin/python -m pytest -v -p no:cacheprovider -rfE -o timeout=1800 \
	  --basetemp=$${TMPDIR:-/tmp}/ficco-rehearse-lease-image tests/claims/test_gpu_lease.py \
	  -k test_the_lease_runs_every_part
	$(IMAGE_VENV)/bin/python -m pytest -q -p no:cacheprovider --collect-only -m gpu tests/engine/test_kernels.py

clean:
	rm -rf $(VENV) $(OLDEST_VENV) $(IMAGE_VENV) .pytest_cache
