"""Test-suite wiring: fixtures live in plugin modules under ``tests/fixtures``."""

import pytest

# The fault tier's promises are asserted in its shared Invariants class: show what broke
# (the unresolved slots, the crashed processes) rather than a bare AssertionError.
pytest.register_assert_rewrite("tests.faults.workload")

pytest_plugins = (
    "tests.fixtures.services",
    "tests.fixtures.pg",
    "tests.fixtures.procs",
    "tests.fixtures.proxy",
    "tests.fixtures.measurements",
    "tests.fixtures.sharing",
    "tests.fixtures.logging_state",
)

# A user's project with a test suite of its own, run in a subprocess by
# tests/acceptance/test_user_suite.py: never collected as part of ours.
collect_ignore = ["apps/userproject"]
