"""Test-suite wiring: fixtures live in plugin modules under ``tests/fixtures``."""

pytest_plugins = (
    "tests.fixtures.services",
    "tests.fixtures.pg",
    "tests.fixtures.procs",
    "tests.fixtures.proxy",
    "tests.fixtures.measurements",
    "tests.fixtures.sharing",
)

# A user's project with a test suite of its own, run in a subprocess by
# tests/acceptance/test_user_suite.py: never collected as part of ours.
collect_ignore = ["apps/userproject"]
