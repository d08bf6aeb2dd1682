"""``pglock_check_on_enqueue``: a slot that succeeded or is running is not published.

An in-process app on the in-memory broker and result backend; what was published is
what Celery's ``after_task_publish`` signal saw.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from celery import signals as celery_signals
from celery.result import AsyncResult

from celery_pglock import SKIPPED, PgLockTask
from celery_pglock._config import Settings
from celery_pglock._ledger import SUCCEEDED
from celery_pglock._locks import acquire, release
from celery_pglock.store._database import Database, close_all
from tests.integration.locking import Conn, claim, granted, open_database, skip_rows, terminate

pytestmark = pytest.mark.integration

SLOT = "2026-11-29T18:05:00Z"
SLOTTED = {"pglock_slot": SLOT}
TASK = "enq.job"


def make_app(dsn: str, schema: str, **conf: Any) -> Celery:
    """An app whose ``enq.job`` checks slots at enqueue, locked on ``<schema>:job``."""
    app = Celery("enq", set_as_current=False)
    settings = {
        "broker_url": "memory://",
        "result_backend": "cache+memory://",
        "pglock_dsn": dsn,
        "pglock_schema": schema,
        "pglock_namespace": schema,
        "pglock_check_on_enqueue": True,
    }
    app.conf.update({**settings, **conf})

    @app.task(base=PgLockTask, name=TASK, shared=False)
    def job() -> None: ...

    return app


@pytest.fixture
def apps() -> Iterator[list[Celery]]:
    """Apps a test builds, closed after it with this process's pools."""
    built: list[Celery] = []
    yield built
    for app in built:
        app.close()
    close_all()


Make = Callable[..., Celery]


@pytest.fixture
def make(pg_dsn: str, pglock_schema: str, apps: list[Celery]) -> Make:
    """Build an app on this test's schema; keyword arguments override its settings."""

    def build(**conf: Any) -> Celery:
        apps.append(make_app(conf.pop("dsn", pg_dsn), pglock_schema, **conf))
        return apps[-1]

    return build


@pytest.fixture
def app(make: Make) -> Celery:
    """The app, checking at enqueue."""
    return make()


@pytest.fixture
def db(pg_dsn: str, pglock_schema: str) -> Iterator[Database]:
    """The library on this test's schema (tables created on open), closed after."""
    with open_database(Settings(dsn=pg_dsn, schema=pglock_schema)) as database:
        yield database


@pytest.fixture
def job(pglock_schema: str) -> str:
    """The lock name of ``enq.job`` in this test's namespace."""
    return f"{pglock_schema}:{TASK}"


@pytest.fixture
def published() -> Iterator[list[str]]:
    """Ids of the ``enq.job`` messages published during the test."""
    ids: list[str] = []

    def receiver(sender: str | None = None, headers: Any = None, **_: Any) -> None:
        if sender == TASK:
            ids.append(headers["id"])

    celery_signals.after_task_publish.connect(receiver, weak=False)
    yield ids
    celery_signals.after_task_publish.disconnect(receiver)


def test_done_slot_is_not_published(
    app: Celery, db: Database, job: str, published: list[str]
) -> None:
    """A slot that succeeded: nothing published, the result is SKIPPED 'done' at once."""
    ran = granted(acquire(db, claim(job, SLOT, "t-ran"), "session", None))
    release(db, ran, SUCCEEDED)

    result = app.tasks[TASK].apply_async(headers=SLOTTED)

    assert [] == published
    assert SKIPPED == AsyncResult(result.id, app=app).state
    meta = result.get(timeout=1)
    assert ("done", job, SLOT, ran.token) == (
        meta["reason"],
        meta["lock"],
        meta["slot"],
        meta["token"],
    )
    assert "t-ran" == meta["holder"]["task_id"]


def test_enqueue_skip_is_logged(
    app: Celery, db: Database, pg_conn: Conn, job: str, published: list[str]
) -> None:
    """The refused message is in the skips log, under its result's id."""
    release(db, granted(acquire(db, claim(job, SLOT, "t-ran"), "session", None)), SUCCEEDED)

    result = app.tasks[TASK].apply_async(headers=SLOTTED)

    [row] = skip_rows(pg_conn, db, job)
    assert (SLOT, "done", result.id, "t-ran") == (
        row["slot"],
        row["reason"],
        row["task_id"],
        row["holder_task_id"],
    )


def test_running_slot_is_not_published(
    app: Celery, db: Database, job: str, published: list[str]
) -> None:
    """A slot a live holder runs: nothing published, SKIPPED 'locked' naming the holder."""
    running = granted(acquire(db, claim(job, SLOT, "t-running"), "session", None))

    result = app.tasks[TASK].apply_async(headers=SLOTTED)
    release(db, running, SUCCEEDED)

    assert [] == published
    meta = result.get(timeout=1)
    assert ("locked", "t-running") == (meta["reason"], meta["holder"]["task_id"])


def test_slot_whose_holder_died_is_published(
    app: Celery, db: Database, pg_conn: Conn, job: str, published: list[str]
) -> None:
    """A 'running' row whose holder is gone does not stop the message (it must run again)."""
    dead = granted(acquire(db, claim(job, SLOT, "t-dead"), "session", None))
    terminate(pg_conn, dead.connection.info.backend_pid)

    result = app.tasks[TASK].apply_async(headers=SLOTTED)

    assert [result.id] == published


def test_new_slot_is_published_and_nothing_logged(
    app: Celery, db: Database, pg_conn: Conn, job: str, published: list[str]
) -> None:
    """A slot never run is published as usual; the look-up writes nothing."""
    result = app.tasks[TASK].apply_async(headers=SLOTTED)

    assert [result.id] == published
    assert [] == skip_rows(pg_conn, db, job)


def test_message_without_slot_is_published(app: Celery, published: list[str]) -> None:
    """An ad-hoc message without a slot is not looked up."""
    result = app.tasks[TASK].delay()

    assert [result.id] == published


def test_without_the_option_a_done_slot_is_published(
    make: Make, db: Database, job: str, published: list[str]
) -> None:
    """Off by default: the worker decides, as before."""
    release(db, granted(acquire(db, claim(job, SLOT), "session", None)), SUCCEEDED)
    app = make(pglock_check_on_enqueue=False)

    result = app.tasks[TASK].apply_async(headers=SLOTTED)

    assert [result.id] == published


def test_without_result_backend_the_skip_is_returned(
    make: Make, db: Database, job: str, published: list[str]
) -> None:
    """With no result backend, the returned result still says SKIPPED and gives the meta."""
    release(db, granted(acquire(db, claim(job, SLOT), "session", None)), SUCCEEDED)
    app = make(result_backend=None)

    result = app.tasks[TASK].apply_async(headers=SLOTTED)

    assert [] == published
    assert (SKIPPED, "done") == (result.state, result.get()["reason"])


def test_unreachable_database_publishes(make: Make, published: list[str]) -> None:
    """If the look-up fails, the message is published: the worker still checks it."""
    app = make(dsn="postgresql://nobody@127.0.0.1:1/none")

    result = app.tasks[TASK].apply_async(headers=SLOTTED)

    assert [result.id] == published


def test_retrofitted_task_checks_its_slot_and_publishes_other_slots(
    pg_dsn: str, pglock_schema: str, apps: list[Celery], published: list[str]
) -> None:
    """Under ``pglock_all_tasks`` (a slot locked alone) the check still finds a slot that
    succeeded, and publishes any other slot of the task: distinct work."""
    app = Celery("enq", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        pglock_dsn=pg_dsn,
        pglock_schema=pglock_schema,
        pglock_namespace=pglock_schema,
        pglock_check_on_enqueue=True,
        pglock_all_tasks=True,
    )
    apps.append(app)

    @app.task(name=TASK, shared=False)
    def job() -> None: ...

    assert "SUCCESS" == job.apply(headers=SLOTTED).state  # run once, in this process

    again = job.apply_async(headers=SLOTTED)
    other = job.apply_async(headers={"pglock_slot": "2026-11-29T18:06:00Z"})

    assert [other.id] == published
    assert "done" == again.get(timeout=1)["reason"]
