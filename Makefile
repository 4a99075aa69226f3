# The README's commands. Each sets up what it needs on a fresh machine:
# a virtual environment, torch 2.13.0 (CPU build) unless a torch is already installed,
# the other dependencies, and the C++ extension (built without build isolation).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# transformers (+ accelerate, for its Trainer): the optional Hugging Face integration (fastformer.hf),
# transformers pinned to the version it is tested with, written once in fastformer/hf/_version.py;
# torch is installed first, so accelerate takes that one
TRANSFORMERS_VERSION := $(shell sed -n 's/^TESTED = "\(.*\)"/\1/p' fastformer/hf/_version.py)
DEPS := triton pybind11 'ninja>=1.12' pytest pytest-benchmark hypothesis tqdm matplotlib sacrebleu tokenizers numpy \
	transformers==$(TRANSFORMERS_VERSION) accelerate

.PHONY: setup build demo test test-fast bench gpu-check clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.deps: $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet $(DEPS)
	@touch $@

setup: $(VENV)/.deps

# pip's editable build compiles the extension from scratch (minutes), so it runs only when the build's
# inputs changed: the Python code is used in place. `make clean` (or `make -B build`) forces it.
BUILD_INPUTS := setup.py tools/libstdcxx.py $(shell find csrc -type f 2>/dev/null)

$(VENV)/.built: $(VENV)/.deps $(BUILD_INPUTS)
	$(PIP) install --quiet --use-pep517 --no-build-isolation --no-deps -e .
	@touch $@

build: $(VENV)/.built

demo: build
	$(PY) -m fastformer train

# The whole suite (what CI runs), and the fast tier: every op on the reference and cpu backends, the
# model, hostile input and determinism, in under 5 minutes on 2 cores (tests/conftest.py says what
# it leaves out). FASTFORMER_CUDA_SIMT=off: the fast tier never builds the SIMT harness.
PYTEST_FLAGS ?=
test: build
	$(PY) -m pytest -q $(PYTEST_FLAGS)

test-fast: build
	FASTFORMER_CUDA_SIMT=off $(PY) -m pytest -q -m "not slow" $(PYTEST_FLAGS)

bench: build
	$(PY) -m pytest benchmarks/ --benchmark-only --benchmark-group-by=group -q

# The build with the CUDA kernels, every gpu-marked test, `python -m fastformer check` and the GPU
# benchmarks, in at most GPU_CHECK_BUDGET seconds after the set-up, logged under benchmarks/results/<gpu-name>/ (benchmarks/gpu_check.py).
# It runs in its own venv, $(GPU_VENV), on the CUDA torch that is here already ($(PYTHON)'s, else
# /opt/torch/.venv's; torch==2.13.0 from the registry only where there is none), installing what
# else is missing where there is network and running without it where there is none
# (tools/gpu_env.py). Fails, saying why in one line, on a machine without a CUDA GPU.
GPU_VENV ?= .venv-gpu
GPU_CHECK_BUDGET ?= 540
gpu-check:
	@$(PYTHON) tools/gpu_env.py --venv $(GPU_VENV) $(DEPS)
	$(GPU_VENV)/bin/python benchmarks/gpu_check.py --budget $(GPU_CHECK_BUDGET)

clean:
	rm -rf build *.egg-info fastformer/*.so .pytest_cache .benchmarks $(VENV)/.built
