# Everything a fresh machine needs: `make demo` runs the workflow, `make test` runs the checks
# (`make test-fast` skips the slow multi-process tests).
# TORCH pins the CPU build that this kind of machine keeps on disk; a GPU user overrides it:
#   make demo TORCH="torch --index-url https://download.pytorch.org/whl/cu124"
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo demo-gpt test test-fast lint typecheck unit bench gpu-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	bash scripts/demo.sh $(BIN)

demo-gpt: $(STAMP)
	bash scripts/demo_gpt.sh $(BIN)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy partitioner runtime cli.py cli_options.py cli_render

# --durations=15 lists the slowest tests after the run, so a slow new test shows in review.
# WORKERS pytest processes share the tests (pytest-xdist): the multi-process tests leave a core idle
# while their ranks start and wait, so 2 workers on 2 cores take 11 minutes where one takes 17.
WORKERS ?= 2
unit: $(STAMP)
	$(BIN)/python -m pytest -n $(WORKERS) --durations=15

test: lint typecheck unit

# The lane to run while working: lint, then every test not marked slow (multi-process and whole-model
# tests are); `make test` stays the full gate.
test-fast: lint
	$(BIN)/python -m pytest -n $(WORKERS) -m "not slow" --durations=15

# The benchmarks write benchmarks/results/*.{json,md}; they take minutes each (see the README).
bench: $(STAMP)
	$(BIN)/python benchmarks/bench_profile.py
	$(BIN)/python benchmarks/bench_optimizer.py
	$(BIN)/python benchmarks/bench_sync.py
	$(BIN)/python benchmarks/bench_runtime.py
	$(BIN)/python benchmarks/bench_fidelity.py
	$(BIN)/python benchmarks/bench_precision.py

# On a CUDA machine, with its own PyTorch (no venv, nothing downloaded): see scripts/gpu_check.sh.
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info
