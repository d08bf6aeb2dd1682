"""The task's logic, in the test mode: no PostgreSQL, nothing locked."""

import pytest
from proj.celery import app, nightly_report


@pytest.fixture(autouse=True)
def _no_locks():
    app.conf.update(pglock_enabled=False, task_always_eager=True)
    yield
    app.conf.update(pglock_enabled=True, task_always_eager=False)


def test_the_report_is_written():
    assert "report for 2026-12-01" == nightly_report("2026-12-01")
    assert "report for 2026-12-01" == nightly_report.delay("2026-12-01").get()


def test_without_locks_a_duplicate_runs_again():
    slot = {"pglock_slot": "2026-12-01"}
    first = nightly_report.apply_async(("2026-12-01",), headers=slot)
    again = nightly_report.apply_async(("2026-12-01",), headers=slot)

    assert ("SUCCESS", "SUCCESS") == (first.state, again.state)
