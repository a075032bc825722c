# The two commands: `make up` runs the stack, `make test` runs the tests.
# Both create (or reuse) a virtualenv in .venv and install the project into it.
# e.g. make up UP_ARGS="--workers 2"
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvl-installed
PYTEST_ARGS ?=
UP_ARGS ?=

.PHONY: up test install bench gpu-check clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(VENV)/bin/kvledger up $(UP_ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m bench.model --quick
	$(PY) -m bench.coordinator --quick

# The CUDA path (kernels compiled for the GPU, bench.kernels, bench.model on cuda): one JSON line.
gpu-check: $(STAMP)
	$(PY) -m bench.gpu_check

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .kvl-state
