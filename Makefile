# One entry point. `make run` and `make test` each set up .venv first (idempotent).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STACK ?= local

.PHONY: setup run test lint unit integration bench clean

$(BIN)/geotrain: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch==2.13.0 is a CPU build that pip takes from this machine's disk
	$(BIN)/pip install -q -e '.[infra,dev,plot]'
	touch $@

setup: $(BIN)/geotrain

run: setup  ## the main job: a real 3-region training on the local stack
	$(BIN)/geotrain validate --stack $(STACK)
	$(BIN)/geotrain train --stack $(STACK)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint  ## lint, type check, then every test (root-only tests skip with a reason)
	$(BIN)/python -m pytest -q -rs --durations=40 tests; rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

unit: setup
	$(BIN)/python -m pytest -q tests/unit

bench: setup
	$(BIN)/python benchmarks/codec_and_sync.py

clean:
	rm -rf .geotrain out
