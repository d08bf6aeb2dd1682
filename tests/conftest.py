"""Test-suite wiring: fixtures live in plugin modules under ``tests/fixtures``."""

pytest_plugins = (
    "tests.fixtures.services",
    "tests.fixtures.pg",
    "tests.fixtures.procs",
    "tests.fixtures.proxy",
)
