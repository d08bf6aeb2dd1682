"""Transaction scope: the task body, the ledger row and the commit are one transaction.

Tasks run in-process through ``Task.apply`` (no worker); the slot comes in the
``pglock_slot`` header, as beat sends it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from celery import Celery, Task
from psycopg import sql

from celery_pglock import LockLost, PgLockTask, signals
from celery_pglock._config import app_settings
from celery_pglock._keys import lock_key
from celery_pglock._locks import acquire
from celery_pglock._protocol import Lease, Skip
from celery_pglock.store._connections import HOSTNAME
from celery_pglock.store._database import Database, close_all, database
from tests.fixtures.procs import wait_until
from tests.integration.locking import (
    Conn,
    claim,
    lock_holders,
    pick,
    run_row,
    skipped,
    terminate,
    the_run,
)

pytestmark = pytest.mark.integration

SLOT = "2026-11-29"

Body = Callable[[Lease], object]


@pytest.fixture
def app(pg_dsn: str, pglock_schema: str, pg_conn: Conn) -> Iterator[Celery]:
    """An in-process app locking in the test's schema, and an ``effects`` table to write."""
    celery = Celery("txn", set_as_current=False)
    celery.conf.update(
        pglock_dsn=pg_dsn, pglock_schema=pglock_schema, pglock_namespace=pglock_schema
    )
    table = sql.Identifier(pglock_schema, "effects")
    pg_conn.execute(sql.SQL("CREATE TABLE {} (slot text, token bigint)").format(table))
    try:
        yield celery
    finally:
        close_all()


@pytest.fixture
def lock(pglock_schema: str) -> str:
    """The rollup task's lock name: ``{namespace}:{task name}``, unique to this test."""
    return f"{pglock_schema}:tests.rollup"


@pytest.fixture
def db(app: Celery) -> Database:
    """The process's pool the app's tasks use."""
    return database(app_settings(app))


def effects(conn: Conn, db: Database) -> list[tuple[Any, ...]]:
    """What the task bodies wrote (and committed)."""
    query = sql.SQL("SELECT slot, token FROM {} ORDER BY token")
    return conn.execute(query.format(sql.Identifier(db.settings.schema, "effects"))).fetchall()


@dataclass
class Script:
    """What the next run of the ``rollup`` task does after writing its effect row."""

    fail: bool = False
    body: Body | None = None


@pytest.fixture
def script() -> Script:
    return Script()


@pytest.fixture
def rollup(app: Celery, pglock_schema: str, script: Script) -> Task[Any, Any]:
    """A transaction-scope task that writes one effect row, then follows ``script``."""
    insert = sql.SQL("INSERT INTO {} VALUES (%s, %s)").format(
        sql.Identifier(pglock_schema, "effects")
    )

    @app.task(
        bind=True, base=PgLockTask, name="tests.rollup", pglock_scope="transaction", shared=False
    )
    def rollup(self: Any) -> int:
        lease: Lease = self.pglock
        lease.connection.execute(insert, (lease.slot, lease.token))
        if script.body is not None:
            script.body(lease)
        if script.fail:
            raise RuntimeError("boom")
        return lease.token

    return rollup


def run(task: Task[Any, Any], task_id: str) -> Any:
    return task.apply(task_id=task_id, headers={"pglock_slot": SLOT})


def test_success_commits_body_and_ledger_together(
    rollup: Task[Any, Any], script: Script, db: Database, pg_conn: Conn, lock: str
) -> None:
    """Until the task returns neither its write nor the claim is visible; then both are."""
    seen_during: list[Any] = []
    script.body = lambda _: seen_during.append(
        (run_row(pg_conn, db, lock, SLOT), effects(pg_conn, db))
    )

    result = run(rollup, "t-1")

    row = the_run(pg_conn, db, lock, SLOT)
    assert [(None, [])] == seen_during
    assert "SUCCESS" == result.state
    assert [(SLOT, result.result)] == effects(pg_conn, db)
    expected = {"state": "succeeded", "attempts": 1, "token": result.result, "task_id": "t-1"}
    assert expected == pick(row, *expected)


def test_failure_rolls_back_body_and_records_failed(
    rollup: Task[Any, Any], script: Script, db: Database, pg_conn: Conn, lock: str
) -> None:
    """A failing body's writes roll back; the ledger still records the failed attempt."""
    tokens: list[int] = []
    script.fail, script.body = True, lambda lease: tokens.append(lease.token)

    result = run(rollup, "t-1")

    row = the_run(pg_conn, db, lock, SLOT)
    assert "FAILURE" == result.state
    assert [] == effects(pg_conn, db)
    expected = {
        "state": "failed",
        "attempts": 1,
        "token": tokens[0],
        "task_id": "t-1",
        "reason": "RuntimeError: boom",
    }
    assert expected == pick(row, *expected)
    assert [] == lock_holders(pg_conn, lock)


def test_retry_after_failure_commits_second_attempt(
    rollup: Task[Any, Any], script: Script, db: Database, pg_conn: Conn, lock: str
) -> None:
    """After a failed attempt the slot runs again: attempt 2, larger token, one effect."""
    tokens: list[int] = []
    script.fail, script.body = True, lambda lease: tokens.append(lease.token)
    run(rollup, "t-1")
    script.fail = False

    result = run(rollup, "t-1")

    row = the_run(pg_conn, db, lock, SLOT)
    assert result.result > tokens[0]
    assert [(SLOT, result.result)] == effects(pg_conn, db)
    expected = {"state": "succeeded", "attempts": 2, "token": result.result}
    assert expected == pick(row, *expected)


def test_duplicate_after_success_does_not_run(
    rollup: Task[Any, Any], db: Database, pg_conn: Conn, lock: str
) -> None:
    """A redelivered message of a succeeded slot is skipped: its body never writes."""
    first = run(rollup, "t-1")

    again = run(rollup, "t-2")

    assert "SUCCESS" != again.state
    assert [(SLOT, first.result)] == effects(pg_conn, db)
    assert 1 == the_run(pg_conn, db, lock, SLOT)["attempts"]


def test_running_transaction_holder_is_named_in_a_locked_skip(
    rollup: Task[Any, Any], script: Script, db: Database, lock: str
) -> None:
    """While a transaction-scope task runs, a claimer is skipped as locked, naming that task."""
    skips: list[Skip] = []
    script.body = lambda _: skips.append(
        skipped(acquire(db, claim(lock, SLOT, "t-2"), "session", None))
    )

    run(rollup, "t-1")

    [skip] = skips
    assert "locked" == skip.reason
    assert skip.holder is not None
    expected = {"host": HOSTNAME, "pid": os.getpid(), "task_id": "t-1"}
    assert expected == pick(skip.holder, *expected)
    assert skip.holder["since"] is not None


def test_transaction_lock_lives_exactly_as_long_as_the_body(
    rollup: Task[Any, Any], script: Script, pg_conn: Conn, lock: str
) -> None:
    """The transaction-scope lock is held by the task's connection while the body runs only."""
    seen: list[tuple[list[int], int]] = []
    script.body = lambda lease: seen.append(
        (lock_holders(pg_conn, lock), lease.connection.info.backend_pid)
    )

    run(rollup, "t-1")

    [(holders, own)] = seen
    assert [own] == holders
    assert [] == lock_holders(pg_conn, lock)


def test_session_lock_taken_by_a_failed_body_is_freed(
    rollup: Task[Any, Any], script: Script, pg_conn: Conn, lock: str
) -> None:
    """A failing body's own session-level lock on its connection does not go back to the pool."""
    nested = f"{lock}:nested"
    script.fail = True
    script.body = lambda lease: lease.connection.execute(
        "SELECT pg_advisory_lock(%s)", (lock_key(nested),)
    )

    run(rollup, "t-1")

    wait_until(lambda: lock_holders(pg_conn, nested) == [], message="the nested lock to be freed")


def test_failed_run_is_not_watched_after_it_ended(
    app: Celery, rollup: Task[Any, Any], script: Script, pg_conn: Conn
) -> None:
    """After a failed run the heartbeat forgets its lease: no lock_lost for a finished task."""
    app.conf.pglock_lease = 0.3  # pings every 0.2 s while registered
    backends: list[int] = []
    script.fail, script.body = (
        True,
        lambda lease: backends.append(lease.connection.info.backend_pid),
    )
    lost: list[dict[str, Any]] = []

    def on_lost(**event: Any) -> None:
        lost.append(event)

    signals.lock_lost.connect(on_lost, weak=False)
    try:
        run(rollup, "t-1")
        terminate(pg_conn, backends[0])  # the pooled connection it used goes away
        # Absence over a window: five heartbeat intervals with nothing reported.
        with pytest.raises(AssertionError, match="timed out"):
            wait_until(lambda: lost, timeout=1.0, message="a lock_lost signal")
    finally:
        signals.lock_lost.disconnect(on_lost)


def test_a_run_without_slot_whose_commit_was_lost_fails(
    rollup: Task[Any, Any], script: Script, db: Database, pg_conn: Conn
) -> None:
    """Without a slot too: a transaction-scope run whose session ends before its commit
    (its writes rolled back) fails with ``LockLost``, as ``advisory_lock`` does; it is not
    reported a success."""
    script.body = lambda lease: terminate(pg_conn, lease.connection.info.backend_pid)

    result = rollup.apply(task_id="t-lost")

    assert "FAILURE" == result.state
    assert isinstance(result.result, LockLost)
    assert [] == effects(pg_conn, db)
