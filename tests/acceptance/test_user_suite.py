"""A user's own test suite (tests/apps/userproject), run as its owner would run it: pytest
in the project, celery-pglock's plugin loaded by its entry point, nothing of our suite.

In the test mode it needs no PostgreSQL at all; with the plugin's fixtures it gets a
throwaway server of its own (no ``PGLOCK_TEST_DSN`` given)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.acceptance

PROJECT = Path(__file__).parent.parent / "apps" / "userproject"
NOWHERE = "postgresql://nobody@127.0.0.1:9/none?connect_timeout=1"


def run_suite(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PGLOCK_")}
    environ.pop("PYTHONPATH", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *args],
        cwd=PROJECT,
        env={**environ, "PYTHONPATH": str(PROJECT), **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_in_test_mode_the_suite_needs_no_postgresql() -> None:
    done = run_suite("tests/test_logic.py", PGLOCK_DSN=NOWHERE)

    assert 0 == done.returncode, done.stdout + done.stderr
    assert "2 passed" in done.stdout


def test_with_the_plugins_throwaway_server_each_slot_runs_once() -> None:
    done = run_suite()

    assert 0 == done.returncode, done.stdout + done.stderr
    assert "5 passed" in done.stdout
