"""A user's own test suite (tests/apps/userproject), run as its owner would run it: pytest
in the project, celery-pglock's plugin loaded by its entry point, nothing of our suite.

In the test mode it needs no PostgreSQL at all; with the plugin's fixtures it gets a
throwaway server of its own (no ``PGLOCK_TEST_DSN`` given)."""

from __future__ import annotations

import os
import re
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


DOC = Path(__file__).parents[2] / "docs" / "testing.md"
FILE_BLOCK = re.compile(r"```python\n# (?P<path>[\w/.]+\.py)\n(?P<code>.*?)```", re.DOTALL)


def page_files() -> dict[str, str]:
    """docs/testing.md's files, as written: each ```python block opening with its path."""
    return {m["path"]: m["code"] for m in FILE_BLOCK.finditer(DOC.read_text())}


def write_project(root: Path, files: dict[str, str]) -> Path:
    for path, code in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(code)
    return root


def run_page(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m pytest -q`` in ``root``, as the page says, no setting of ours."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PGLOCK_")}
    environ.pop("PYTHONPATH", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=root,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_the_pages_complete_example_runs_as_written(tmp_path: Path) -> None:
    """docs/testing.md's complete example (app, logic tests, once-per-slot tests, the
    conftest line) passes as written, on a throwaway server of the plugin's."""
    files = {k: v for k, v in page_files().items() if k.startswith(("proj/", "tests/"))}
    done = run_page(write_project(tmp_path, files))

    assert {
        "proj/celery.py",
        "tests/conftest.py",
        "tests/test_logic.py",
        "tests/test_once.py",
    } == set(files)
    assert 0 == done.returncode, done.stdout + done.stderr
    assert "4 passed" in done.stdout


def test_the_pages_test_mode_conftest_needs_no_postgresql(tmp_path: Path) -> None:
    """The page's test-mode conftest.py with its app and logic tests: passes with a DSN
    that leads nowhere."""
    files = page_files()
    wanted = {k: files[k] for k in ("conftest.py", "proj/celery.py", "tests/test_logic.py")}
    done = run_page(write_project(tmp_path, wanted), "tests/test_logic.py")

    assert 0 == done.returncode, done.stdout + done.stderr
    assert "1 passed" in done.stdout


def test_without_the_conftest_line_the_last_example_errors(tmp_path: Path) -> None:
    """Why the page asks for the line: without it the last example errors (here, with
    pytest-celery installed, on its Docker-based celery_worker; without pytest-celery on
    `fixture 'celery_app' not found`)."""
    files = {k: v for k, v in page_files().items() if k.startswith(("proj/", "tests/"))}
    del files["tests/conftest.py"]
    done = run_page(write_project(tmp_path, files), "tests/test_once.py", "-k", "pytest_celery")
    errors = [line for line in done.stdout.splitlines() if line.startswith("ERROR")]

    assert 0 != done.returncode
    assert ["test_with_pytest_celerys_worker"] == [e.split("::")[1].split("[")[0] for e in errors]
