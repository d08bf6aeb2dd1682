"""``pglock_enabled = False``: the test mode for users' own suites. Tasks run unlocked and
touch no database, whatever the DSN says; one log line says so. Run against an address
where nothing listens, so that any connection attempt would fail the test."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_pglock import ConfigurationError, PgLockTask

pytestmark = pytest.mark.integration

NOWHERE = "postgresql://nobody@127.0.0.1:9/none?connect_timeout=1"
SLOT = {"pglock_slot": "2026-12-01"}


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("testmode", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        pglock_dsn=NOWHERE,
        pglock_enabled=False,
        pglock_check_on_enqueue=True,
    )

    @app.task(base=PgLockTask, name="testmode.job", shared=False)
    def job(value: Any = None) -> Any:
        return value

    yield app
    app.close()


def test_eager_calls_run_unlocked_and_every_duplicate_runs(app: Celery) -> None:
    """Without locks nothing is deduplicated: both calls of one slot run."""
    job = app.tasks["testmode.job"]

    first = job.apply(("a",), headers=SLOT)
    second = job.apply(("b",), headers=SLOT)

    assert [("SUCCESS", "a"), ("SUCCESS", "b")] == [
        (first.state, first.get()),
        (second.state, second.get()),
    ]


def test_direct_calls_and_delay_in_eager_mode_behave_as_celerys(app: Celery) -> None:
    app.conf.task_always_eager = True
    job = app.tasks["testmode.job"]

    assert "direct" == job("direct")
    assert "delayed" == job.delay("delayed").get()
    assert "async" == job.apply_async(("async",), headers=SLOT).get()


def test_without_any_dsn_too(app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test suite needs no PostgreSQL setting at all."""
    monkeypatch.delenv("PGLOCK_DSN", raising=False)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    app.conf.pglock_dsn = None

    assert "x" == app.tasks["testmode.job"].apply(("x",), headers=SLOT).get()


def test_one_warning_says_the_locks_are_off(app: Celery, caplog: pytest.LogCaptureFixture) -> None:
    job = app.tasks["testmode.job"]
    with caplog.at_level(logging.WARNING, logger="celery_pglock"):
        job.apply(("a",))
        job.apply(("b",))

    said = [r for r in caplog.records if getattr(r, "action", None) == "pglock_disabled"]
    assert 1 == len(said)
    assert "pglock_enabled = False" in said[0].getMessage()


def test_a_setting_that_is_not_a_bool_is_refused(app: Celery) -> None:
    app.conf.pglock_enabled = "no"

    with pytest.raises(ConfigurationError, match="pglock_enabled must be True or False"):
        app.tasks["testmode.job"].apply(("a",)).get()
