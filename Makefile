# Two entry points (see README "Quick start"):
#   make check   set up .venv and run `flamia-verify check` with its defaults
#   make test    set up .venv, check the formatting and lint (ruff), the import layers
#                (lint-imports, pyproject.toml), the types (mypy), then run the fast tier of the tests
#                (what CI runs, .ci/run)
#   make test-slow  the slow tier: the tests listed in tests/slow_tests.txt (measured, 2 s or more each)
#   make test-all   the lint and types, then every test in one run (before pushing a change to the checks)
#   make format  apply ruff's formatting and its safe lint fixes
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch 2.13.0's CPU build is on local disk on the CI/developer machines; pinning it
# here keeps pip from pulling a multi-GB CUDA build. The GPU machine ships torch 2.11.
TORCH_CPU := torch==2.13.0

PYTEST := OMP_NUM_THREADS=1 TRITON_INTERPRET=1 $(BIN)/python -m pytest -n 2 --dist loadgroup -q

.PHONY: setup check lint test test-slow test-all format clean

$(BIN)/flamia-verify: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_CPU)
	$(BIN)/pip install -q -e '.[test]'
	touch $@

setup: $(BIN)/flamia-verify

check: setup
	$(BIN)/flamia-verify check

lint: setup
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy

test: lint
	$(PYTEST) -m "not slow"

test-slow: setup
	$(PYTEST) -m slow

test-all: lint
	$(PYTEST)

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) flamia-report .pytest_cache .hypothesis .mypy_cache
