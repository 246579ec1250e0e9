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

.PHONY: install broker-up broker-down demo test test-unit test-integration lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# One install for everything: pip settles faust-streaming's and huggingface-hub's click pins together.
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

broker-up: install
	$(BIN)/flywheel broker up

broker-down:
	-$(BIN)/flywheel broker down

demo: broker-up
	$(BIN)/python -m hebrus_flywheel.demo

test: broker-up
	$(BIN)/python -m pytest -q tests

test-unit: install
	$(BIN)/python -m pytest -q tests/unit

test-integration: broker-up
	$(BIN)/python -m pytest -q -m integration tests/integration

lint: install
	$(BIN)/ruff check .
	# import-linter and mypy read packages from disk: give them the installed layout.
	$(BIN)/python tools/lint_tree.py .lint
	cd .lint && PYTHONPATH=$(CURDIR)/.lint $(CURDIR)/$(BIN)/lint-imports $(CURDIR)/pyproject.toml
	cd .lint && $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/pyproject.toml -p hebrus_flywheel

bench: broker-up
	for b in bench/*.py; do $(BIN)/python $$b || exit 1; done

clean: broker-down
	rm -rf $(VENV) .flywheel demo-out .lint
