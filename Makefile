# hebrus-flywheel — every target does its own set-up on a fresh machine.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export FLYWHEEL_HOME ?= $(CURDIR)/.flywheel
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install lock pin-jars broker-up broker-down storage-up storage-down demo test test-unit test-integration lint bench clean

LOCK := requirements.lock
# pip-compile's flags for `make lock`; `make lock LOCK_ARGS=--upgrade` moves every pin.
LOCK_ARGS ?=

# Everything is installed from the hash-checked lock, nothing is resolved here: the lock
# must cover pyproject.toml (tools/lockfile.py check) or this fails telling you to `make lock`.
$(STAMP): pyproject.toml $(LOCK) requirements-build.in tools/lockfile.py
	# A half-deleted venv (bin/python without pyvenv.cfg) would install into the base Python.
	test -x $(BIN)/python -a -f $(VENV)/pyvenv.cfg || $(PY) -m venv --clear $(VENV)
	$(BIN)/python tools/lockfile.py check
	# The installer and build backend first (pip cannot safely replace itself mid-install).
	$(BIN)/python tools/lockfile.py extract pip setuptools wheel > $(VENV)/build.lock
	$(BIN)/python -m pip install -q --require-hashes --no-deps -r $(VENV)/build.lock
	$(BIN)/python -m pip install -q --require-hashes --no-deps -r $(LOCK)
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

# Re-pin requirements.lock (hashes included) from pyproject.toml + requirements-build.in
# for this platform (Linux x86_64, CPython 3.11); existing pins are kept unless they no
# longer fit or LOCK_ARGS=--upgrade. Commit the result.
lock:
	test -x $(BIN)/python -a -f $(VENV)/pyvenv.cfg || $(PY) -m venv --clear $(VENV)
	test -x $(BIN)/pip-compile || $(BIN)/python -m pip install -q 'pip-tools>=7.4'
	$(BIN)/pip-compile -q --generate-hashes --allow-unsafe --strip-extras --no-emit-find-links \
	  --extra dev $(LOCK_ARGS) -o $(LOCK) pyproject.toml requirements-build.in
	$(BIN)/python tools/lockfile.py check

# Re-pin streams/kafka/jars.sha256 after changing the Kafka version (streams/kafka/kafka.env)
# or streams/kafka/pom.xml; review the diff and commit it.
pin-jars: install
	$(BIN)/flywheel broker pin-jars

broker-up: install
	$(BIN)/flywheel broker up

broker-down:
	-$(BIN)/flywheel broker down

# The embedded S3-compatible store (SeaweedFS built from its pinned Go module, TLS, per-role
# keys) for the s3:// snapshot tests.
storage-up: install
	$(BIN)/flywheel storage up

storage-down:
	-$(BIN)/flywheel storage down

demo: broker-up
	$(BIN)/python -m hebrus_flywheel.demo

# The per-family selftest matrix (marker family_matrix: one capture-to-train run per
# generated family, each on its own topic namespace and work directory, mostly waiting on
# the broker and on worker start-up) runs after the rest in FAMILY_WORKERS pytest
# processes (pytest-xdist). The rest stays in one process: some of its tests stop and
# restart the session broker. Both runs always happen; either failing fails the target.
FAMILY_WORKERS ?= 3

# $(call suite_then_matrix,MARKERS,PATHS): the tests of PATHS that MARKERS select (the
# matrix left out), then the matrix, as above (test and test-integration).
define suite_then_matrix
@status=0; \
$(BIN)/python -m pytest -q --durations=30 -m "$(1)" $(2) \
  || status=$$?; \
$(BIN)/python -m pytest -q --durations=10 -n $(FAMILY_WORKERS) -m family_matrix \
  tests/integration || status=$$?; \
exit $$status
endef

test: broker-up storage-up
	$(call suite_then_matrix,not family_matrix,tests)

test-unit: install
	$(BIN)/python -m pytest -q tests/unit

test-integration: broker-up storage-up
	$(call suite_then_matrix,integration and not family_matrix,tests/integration)

lint: install
	$(BIN)/python tools/lockfile.py check
	$(BIN)/ruff check .
	# import-linter and mypy read packages from disk: give them the installed layout.
	$(BIN)/python tools/lint_tree.py .lint
	cd .lint && PYTHONPATH=$(CURDIR)/.lint $(CURDIR)/$(BIN)/lint-imports $(CURDIR)/pyproject.toml
	cd .lint && $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/pyproject.toml -p hebrus_flywheel

bench: broker-up
	for b in bench/*.py; do $(BIN)/python $$b || exit 1; done

clean: broker-down storage-down
	rm -rf $(VENV) .flywheel demo-out .lint
