# Two commands on a fresh clone: `make demo` and `make test`.
# Both create .venv when it is missing and install the project into it.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.zerodp-installed
# A CPU build of PyTorch; an unpinned `torch` would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
NPROC ?= 2

.PHONY: setup test lint demo bench scaling clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install "$(TORCH_PIN)"
	$(BIN)/pip install -e ".[test,demo,trl]"
	touch $(STAMP)

setup: $(STAMP)

lint: setup
	$(BIN)/ruff check zerodp tests bench examples tools
	$(BIN)/ruff format --check zerodp tests bench examples tools
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python tools/check_module_size.py zerodp

test: lint
	$(BIN)/pytest -q

demo: setup
	$(BIN)/torchrun --standalone --nproc_per_node $(NPROC) examples/train_gpt.py --config examples/gpt_zero3.json

bench: setup
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node 2 bench/step_time.py

# World-size, model-size and memory-budget sweeps with plots (about half an hour on 2 CPU cores).
scaling: setup
	$(BIN)/python bench/scaling.py --json bench/results/scaling.json --plots bench/results

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache runs
