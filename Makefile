# Two entry points, each setting up what it needs in .venv:
#   make test   - the test suite (what CI runs, via .ci/run)
#   make bench  - the benchmark harness (figures in docs/BENCHMARKS.md)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.goodspeed-installed

.PHONY: test test-all bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

test-all: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python -m bench.bench_scheduler

clean:
	rm -rf $(VENV)
