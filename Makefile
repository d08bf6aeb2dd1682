# One entry point for people and CI. Every target installs what it needs into .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: test test-fast lint typecheck pytest test-integration test-failover test-chaos test-compat demo bench screenshots clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,demo]'
	rm -f $(VENV)/.installed-* && touch $@

## make demo: the problem and the cure, on an embedded PostgreSQL
demo: $(STAMP)
	$(BIN)/celery-pglock demo $(ARGS)

## make test: lint, type-check and the whole test suite (make pytest)
test: lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check celery_pglock tests benchmarks examples
	$(BIN)/ruff format --check celery_pglock tests benchmarks examples
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy

## make pytest: the whole suite but the chaos campaigns (make test-chaos), in two phases:
## first every test not marked serial, PYTEST_WORKERS at once (pytest-xdist; most tests
## wait on real processes, not on the CPU), then the serial ones alone (they assert a
## latency or memory bound, or time faults against leases). Both phases run, even after a
## failure. PYTEST_WORKERS=0 runs the first phase in one process too; PYTEST_ARGS narrows
## both (a tier or file path, -k EXPR, not -m), and a phase it leaves empty is no failure.
pytest: $(STAMP)
	$(call phases,)

## make test-fast: the inner loop, in under three minutes: lint, types, the unit, the
## contract and the integration tiers (both phases, as make pytest).
test-fast: lint typecheck
	$(call phases,tests/unit tests/contract tests/integration)

PYTEST_WORKERS ?= 4
# $(call phase,MARKERS,OPTIONS,PATHS): one pytest run; status 5 (nothing selected) is success.
phase = $(BIN)/pytest -m "$(1)" $(2) $(3) $(PYTEST_ARGS) || [ $$? -eq 5 ]
# $(call phases,PATHS): the tests of PATHS (default: all of tests/) not marked serial side by
# side, then the serial ones alone; the status is a failure if either phase failed.
define phases
	@status=0; \
	echo '== $(or $(strip $(1) $(PYTEST_ARGS)),tests): side by side ($(PYTEST_WORKERS) workers)'; \
	$(call phase,not campaign and not serial,-n $(PYTEST_WORKERS),$(1)) || status=1; \
	echo '== $(or $(strip $(1) $(PYTEST_ARGS)),tests): the tests marked serial, alone'; \
	$(call phase,serial and not campaign,-n 0,$(1)) || status=1; \
	exit $$status
endef

## make test-chaos: three short chaos campaigns (about three minutes): active-active, the
## leader on rows behind PgBouncer, the leader on an advisory lock (seed 4242, or
## PGLOCK_CHAOS_SEED=N or random). CI runs it after make test, with a random seed.
test-chaos: $(STAMP)
	$(BIN)/pytest -p no:cacheprovider -m campaign -s -q tests/chaos/test_chaos.py $(PYTEST_ARGS)

## make test-integration: only the PostgreSQL tiers, the contract tests' included (CI runs
## them again on the embedded server)
test-integration: $(STAMP)
	$(call phases,tests/contract tests/integration)

## make test-failover: the failover tier alone (a real primary and streaming replica,
## tests/failover); PG_BIN picks the PostgreSQL binaries (default: the newest found, the
## embedded wheel's). CI runs it again on the system's PostgreSQL.
test-failover: export PGLOCK_TEST_PG_BIN = $(PG_BIN)
test-failover: $(STAMP)
	$(call phases,tests/failover)

## make test-compat: the supported-versions promise. Builds the wheel; on the LOWEST supported
## Celery and psycopg (pyproject.toml's lower bounds, pinned with ==) runs the
## unit tier and the real-worker smoke test; then installs the wheel with only what the
## README's install line names (plus redis and pytest), on the newest versions pip resolves,
## and runs the smoke test from outside the source tree. Needs PGLOCK_TEST_DSN and Redis
## (PGLOCK_TEST_REDIS_URL); a missing one fails the smoke test, never skips it.
COMPAT := .compat
# README's install line (the first `pip install` under "## Install"), run with the venv's pip;
# pip takes celery-pglock from the wheel just built (its version pinned), the rest from PyPI.
README_INSTALL := $(shell sed -n '/^\#\# Install/,/^\#\# /p' README.md | grep -m1 '^pip install')
VERSION := $(shell sed -nE 's/^__version__ = "([^"]+)".*/\1/p' celery_pglock/__init__.py)
LOWEST := $(shell sed -nE 's/^ *"(celery|psycopg)>=([0-9.]+)",.*/\1==\2/p' pyproject.toml)
# psycopg[binary]==3.2.0 asks for an unpublished psycopg-binary: pin the binary directly.
LOWEST_BINARY := $(patsubst psycopg==%,psycopg-binary==%,$(filter psycopg==%,$(LOWEST)))
# What tests/unit imports besides the package (none of the dev-only extras); pytest-xdist
# because pyproject's addopts name --dist and tests/fixtures/sharing.py schedules with it;
# the web extra's packages because tests/unit/test_web.py renders the dashboard's pages.
UNIT_DEPS := pytest pytest-timeout pytest-xdist redis pyyaml rich sqlalchemy ephem \
	waitress werkzeug jinja2 asgiref
VERSIONS := from importlib.metadata import version; \
	print(*(f"{n} {version(n)}" for n in ("celery", "kombu", "psycopg", "redis")), sep=", ")
INSTALLED := import sys, celery_pglock; f = celery_pglock.__file__; print("celery_pglock:", f); \
	sys.exit(None if "site-packages" in f else "not the installed wheel")
# $(call smoke,VENV): the smoke test, copied to a temporary folder and run there with VENV.
define smoke
	dir=$$(mktemp -d) && trap 'rm -rf "$$dir"' EXIT && \
	cp tests/smoke/*.py tests/smoke/pytest-standalone.ini "$$dir" && cd "$$dir" && \
	env -u PYTHONPATH $(CURDIR)/$(1)/bin/python -c '$(INSTALLED)' && \
	PGLOCK_TEST_REQUIRE="postgres,redis,$${PGLOCK_TEST_REQUIRE:-}" env -u PYTHONPATH \
		$(CURDIR)/$(1)/bin/python -m pytest -c pytest-standalone.ini test_smoke.py
endef

test-compat:
	@test $(words $(LOWEST)) -eq 2 || { echo "no lower bounds of celery, psycopg found in pyproject.toml"; exit 1; }
	rm -rf $(COMPAT)
	$(PYTHON) -m venv $(COMPAT)/lowest
	$(COMPAT)/lowest/bin/python -m pip wheel -q --no-deps -w $(COMPAT)/dist .
	$(COMPAT)/lowest/bin/python -m pip install -q $(COMPAT)/dist/*.whl $(LOWEST) $(LOWEST_BINARY) $(UNIT_DEPS)
	$(COMPAT)/lowest/bin/python -m pip check
	@echo "== lowest: $$($(COMPAT)/lowest/bin/python -c '$(VERSIONS)')"
	$(COMPAT)/lowest/bin/python -m pytest tests/unit -p no:cacheprovider -q
	$(call smoke,$(COMPAT)/lowest)
	$(PYTHON) -m venv $(COMPAT)/wheel
	@echo "== README's install line, as written: $(README_INSTALL)"
	@test -n '$(README_INSTALL)' || { echo "README.md has no pip install line under '## Install'"; exit 1; }
	echo "celery-pglock==$(VERSION)" > $(COMPAT)/pin.txt
	cd $(COMPAT)/wheel/bin && PIP_FIND_LINKS=$(CURDIR)/$(COMPAT)/dist PIP_CONSTRAINT=$(CURDIR)/$(COMPAT)/pin.txt ./$(README_INSTALL)
	$(COMPAT)/wheel/bin/python -m pip install -q redis pytest
	$(COMPAT)/wheel/bin/python -m pip check
	@echo "== wheel, newest: $$($(COMPAT)/wheel/bin/python -c '$(VERSIONS)')"
	$(call smoke,$(COMPAT)/wheel)

## make screenshots: the dashboard's tests, writing their screenshots to docs/images
## (headless Chromium; the same services as make test)
screenshots: $(STAMP)
	PGLOCK_SCREENSHOTS=docs/images $(BIN)/pytest -n 0 tests/acceptance/test_dashboard.py tests/acceptance/test_dashboard_django.py

## make bench: side-by-side benchmarks (writes docs/benchmarks.md); ARGS=--quick for a short run
bench: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python -m benchmarks $(ARGS)

## make chaos: one seeded chaos campaign (own PostgreSQL, Redis, PgBouncer on loopback ports);
## SEED=N replays a campaign (default: random, printed), SECONDS=S of faults (default 120),
## ARGS=--active-active for beat without leader election. Exit status 1 on any violation.
chaos: $(STAMP)
	$(BIN)/python -m tests.chaos $(if $(SEED),--seed $(SEED)) --seconds $(or $(SECONDS),120) $(ARGS)

clean:
	rm -rf $(VENV) $(COMPAT) .mypy_cache .ruff_cache .pytest_cache
