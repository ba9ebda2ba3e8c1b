# Two commands set everything up on a fresh machine: `make demo` and `make test`.
# torch is pinned and installed before the project so pip never picks another (CUDA) build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
NPROC ?= 2

.PHONY: demo test lint bench clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[test]" $(TORCH)
	touch $@

demo: $(BIN)/.installed
	$(BIN)/gradientflow demo --nproc $(NPROC)

test: $(BIN)/.installed
	$(BIN)/ruff check src tests examples experiments
	$(BIN)/python -m pytest -q tests

bench: $(BIN)/.installed
	$(BIN)/gradientflow bench --out benchmarks/results

clean:
	rm -rf $(VENV) build src/*.egg-info
