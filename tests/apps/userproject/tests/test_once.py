"""Each slot once, with a real PostgreSQL: the plugin's fixtures and helpers beside
Celery's own (pytest-celery's ``celery_app`` / ``celery_worker``, ``start_worker``)."""

import pytest
from celery.contrib.testing.worker import start_worker
from proj.celery import app, nightly_report

from celery_pglock import PgLockTask
from celery_pglock.testing import assert_skipped, deliver_twice


def test_eager_duplicate_is_skipped(pglock_database):
    pglock_database.configure(app)
    app.conf.task_always_eager = True
    try:
        first, again = deliver_twice(nightly_report, ("2026-12-01",), slot="2026-12-01")
    finally:
        app.conf.task_always_eager = False

    assert "report for 2026-12-01" == first.get()
    assert_skipped(again, "done", slot="2026-12-01")
    [run] = pglock_database.runs()
    assert ("succeeded", "2026-12-01") == (run["state"], run["slot"])


def test_in_a_worker_started_by_the_test(pglock_database):
    pglock_database.configure(app)
    with start_worker(app, perform_ping_check=False):
        first, again = deliver_twice(nightly_report, ("2026-12-02",), slot="2026-12-02")

        assert "report for 2026-12-02" == first.get(timeout=30)
        meta = assert_skipped(again, "done")
    assert first.id == meta["holder"]["task_id"]


@pytest.fixture
def celery_config(pglock_database):
    """pytest-celery's ``celery_app`` built on the plugin's schema."""
    return {
        "broker_url": "memory://",
        "result_backend": "cache+memory://",
        "pglock_dsn": pglock_database.dsn,
        "pglock_schema": pglock_database.schema,
        "pglock_namespace": pglock_database.schema,
    }


def test_with_pytest_celerys_worker(celery_app, celery_worker):
    @celery_app.task(base=PgLockTask, name="proj.tests.locked")
    def locked(day):
        return day

    celery_worker.reload()  # the worker learns the task defined after it started

    first, again = deliver_twice(locked, ("2026-12-03",), slot="2026-12-03")

    assert "2026-12-03" == first.get(timeout=30)
    assert_skipped(again, "done")
