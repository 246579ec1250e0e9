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
	$(BIN)/python -m flywheel.demo

test: broker-up
	$(BIN)/python -m pytest -q tests

test-unit: install
	$(BIN)/python -m pytest -q tests/unit

test-integration: broker-up
	$(BIN)/python -m pytest -q -m integration tests/integration

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy flywheel schemas streams replay consumers train

bench: broker-up
	for b in bench/*.py; do $(BIN)/python $$b || exit 1; done

clean: broker-down
	rm -rf $(VENV) .flywheel demo-out
