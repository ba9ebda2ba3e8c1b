# Two commands set everything up on a fresh machine: `make demo` and `make test`.
# torch is pinned and installed before the project so pip never picks another (CUDA) build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
# The newest torch the suite was run on (pyproject's upper bound is below the next release): `make test-newest`
TORCH_NEWEST := torch==2.14.1
VENV_NEWEST := .venv-newest
NPROC ?= 2

.PHONY: demo test test-newest lint bench clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[test]" $(TORCH)
	touch $@

demo: $(BIN)/.installed
	$(BIN)/gradientflow demo --nproc $(NPROC)

# The static checks first (seconds; mypy's settings are in pyproject.toml), then the suite (~10 minutes on
# 2 cores): two workers, each given whole test files (a rank or a launch waiting on a socket, a timeout or
# a shaped link leaves a core free), its progress in %, and the 15 slowest tests at the end.
lint: $(BIN)/.installed
	$(BIN)/ruff format --check src tests examples experiments
	$(BIN)/ruff check src tests examples experiments
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest tests -n 2 --dist loadfile --durations=15

# The same static checks and suite on the newest torch tested (its own venv; docs/results/torch-versions.md).
$(VENV_NEWEST)/bin/.installed: pyproject.toml
	$(PY) -m venv $(VENV_NEWEST)
	$(VENV_NEWEST)/bin/pip install -q --upgrade pip
	$(VENV_NEWEST)/bin/pip install -q $(TORCH_NEWEST)
	$(VENV_NEWEST)/bin/pip install -q -e ".[test]" $(TORCH_NEWEST)
	touch $@

test-newest: $(VENV_NEWEST)/bin/.installed
	$(VENV_NEWEST)/bin/ruff check src tests examples experiments
	$(VENV_NEWEST)/bin/mypy
	$(VENV_NEWEST)/bin/python -m pytest tests -n 2 --dist loadfile --durations=15

bench: $(BIN)/.installed
	$(BIN)/gradientflow bench --out benchmarks/results

clean:
	rm -rf $(VENV) $(VENV_NEWEST) build src/*.egg-info
