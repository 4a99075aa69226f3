# The README's commands. Each sets up what it needs on a fresh machine:
# a virtual environment, torch 2.13.0 (CPU build) unless a torch is already installed,
# the other dependencies, and the C++ extension (built without build isolation).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# transformers (+ accelerate, for its Trainer): the optional Hugging Face integration (fastformer.hf),
# transformers pinned to the version it is tested with; torch is installed first, so accelerate takes that one
DEPS := triton pybind11 ninja pytest pytest-benchmark hypothesis tqdm matplotlib sacrebleu tokenizers numpy transformers==5.24.0 accelerate

.PHONY: setup build demo test bench gpu-check clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.deps: $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet $(DEPS)
	@touch $@

setup: $(VENV)/.deps

build: setup
	$(PIP) install --quiet --no-build-isolation --no-deps -e .

demo: build
	$(PY) -m fastformer train

test: build
	$(PY) -m pytest -q

bench: build
	$(PY) -m pytest benchmarks/ --benchmark-only --benchmark-group-by=group -q

# Every gpu-marked test, `python -m fastformer check` and the GPU benchmarks, logged under
# benchmarks/results/<gpu-name>/; fails (saying why) on a machine without a CUDA GPU.
gpu-check: setup
	@$(PY) -c "import sys, torch; ok = torch.cuda.is_available(); ok or print('make gpu-check: no CUDA GPU here (torch.cuda.is_available() is False, torch ' + torch.__version__ + ')', file=sys.stderr); sys.exit(0 if ok else 1)"
	$(MAKE) build
	$(PY) benchmarks/gpu_check.py

clean:
	rm -rf build *.egg-info fastformer/*.so .pytest_cache .benchmarks
