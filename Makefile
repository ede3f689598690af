# pathlab: the usual verbs. `make figures` sets everything up on a fresh machine and regenerates figures/.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch by default; on a GPU machine: make setup TORCH="torch"
TORCH ?= torch==2.13.0
PROFILE ?= tiny-cpu

.PHONY: setup figures figures-fast test test-gpu bench lab data clean

$(BIN)/pathlab: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[all]"
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(BIN)/pathlab

setup: $(BIN)/pathlab

data: setup
	$(BIN)/pathlab data prepare debian

figures: setup
	$(BIN)/pathlab figures --profile $(PROFILE)

figures-fast: setup
	$(BIN)/pathlab figures --profile $(PROFILE) --fast

test: setup
	$(BIN)/python -m pytest -q

test-gpu: setup
	$(BIN)/python -m pytest -q -m gpu

bench: setup
	$(BIN)/python benchmarks/bench_kernels.py

lab: setup
	$(BIN)/jupyter lab notebooks/

clean:
	rm -rf build/ .pytest_cache/
