"""Fencing tokens: every grant gets a larger token; fence() rejects superseded holders."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import psycopg
import pytest
from celery import Celery, current_app

from celery_pglock import PgLockError, StaleToken, fence
from celery_pglock._config import Settings
from celery_pglock._ledger import FAILED, SUCCEEDED
from celery_pglock._locks import acquire, release
from celery_pglock.schema import Tables
from celery_pglock.store._database import Database
from tests.fixtures.procs import wait_until
from tests.integration.locking import Conn, claim, granted, open_database, terminate

pytestmark = pytest.mark.integration


@pytest.fixture
def db(pg_dsn: str, pglock_schema: str) -> Iterator[Database]:
    """The library on this test\'s schema (tables created on open), closed after."""
    with open_database(Settings(dsn=pg_dsn, schema=pglock_schema)) as database:
        yield database


def fenced(conn: Conn, db: Database, resource: str) -> int | None:
    """The largest token accepted for ``resource`` (None: never written)."""
    query = db.tables.render("SELECT token FROM {fences} WHERE resource = %(r)s")
    row = conn.execute(query, {"r": resource}).fetchone()
    return None if row is None else int(row[0])


def test_tokens_strictly_increase_across_grants(db: Database, job: str) -> None:
    """Each grant, whatever the lock, slot or outcome, gets a larger token than the last."""
    tokens = []
    for name, slot, outcome in [
        ("a", "s1", FAILED),
        ("a", "s1", SUCCEEDED),
        ("b", None, SUCCEEDED),
        ("a", "s2", SUCCEEDED),
        ("b", "s1", FAILED),
    ]:
        lease = granted(acquire(db, claim(f"{job}-{name}", slot), "session", None))
        tokens.append(lease.token)
        release(db, lease, outcome)

    assert sorted(set(tokens)) == tokens


def test_concurrent_holders_get_distinct_increasing_tokens(db: Database, job: str) -> None:
    """Holders of different locks at the same time get different tokens, in grant order."""
    leases = [granted(acquire(db, claim(f"{job}-{i}"), "session", None)) for i in range(3)]

    assert sorted({lease.token for lease in leases}) == [lease.token for lease in leases]
    for lease in leases:
        release(db, lease, SUCCEEDED)


def test_fence_accepts_equal_and_larger_tokens(db: Database, pg_conn: Conn) -> None:
    """A write with the newest token or a larger one is accepted and raises the mark."""
    for token in (5, 5, 7):
        fence(pg_conn, "report", token, tables=db.tables)

    assert 7 == fenced(pg_conn, db, "report")


def test_fence_rejects_a_smaller_token(db: Database, pg_conn: Conn) -> None:
    """A write with a token older than one already accepted raises StaleToken, naming both."""
    fence(pg_conn, "report", 7, tables=db.tables)

    with pytest.raises(StaleToken) as raised:
        fence(pg_conn, "report", 6, tables=db.tables)

    assert ("report", 6, 7) == (raised.value.resource, raised.value.token, raised.value.newest)
    assert isinstance(raised.value, PgLockError)
    assert 7 == fenced(pg_conn, db, "report")


def test_fences_of_resources_are_independent(db: Database, pg_conn: Conn) -> None:
    """A high token on one resource does not reject a lower one on another."""
    fence(pg_conn, "report", 9, tables=db.tables)

    fence(pg_conn, "invoice", 2, tables=db.tables)

    assert (9, 2) == (fenced(pg_conn, db, "report"), fenced(pg_conn, db, "invoice"))


def test_fence_in_rolled_back_transaction_leaves_no_trace(db: Database, pg_conn: Conn) -> None:
    """A fence whose transaction rolls back (with its write) does not reject later tokens."""
    fence(pg_conn, "report", 3, tables=db.tables)

    with pg_conn.transaction(force_rollback=True):  # the protected write failed
        fence(pg_conn, "report", 9, tables=db.tables)

    assert 3 == fenced(pg_conn, db, "report")
    fence(pg_conn, "report", 4, tables=db.tables)
    assert 4 == fenced(pg_conn, db, "report")


def test_stale_fence_leaves_the_transaction_usable(db: Database, pg_conn: Conn) -> None:
    """StaleToken is raised without aborting the caller's transaction: it can still roll back."""
    fence(pg_conn, "report", 7, tables=db.tables)

    with pg_conn.transaction(force_rollback=True):
        with pytest.raises(StaleToken):
            fence(pg_conn, "report", 6, tables=db.tables)
        assert (1,) == pg_conn.execute("SELECT 1").fetchone()


def test_smaller_token_waiting_on_uncommitted_larger_one_is_rejected(
    pg_dsn: str, db: Database, pg_conn: Conn
) -> None:
    """Concurrent fences serialize: the older token, blocked by a newer uncommitted one, loses."""
    newer = psycopg.connect(pg_dsn)
    older = psycopg.connect(pg_dsn)
    outcome: list[BaseException | None] = []

    def older_write() -> None:
        try:
            fence(older, "report", 5, tables=db.tables)
            outcome.append(None)
        except StaleToken as exc:
            outcome.append(exc)
        older.rollback()

    try:
        fence(newer, "report", 6, tables=db.tables)  # not committed yet
        thread = threading.Thread(target=older_write)
        thread.start()
        waiting = "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s"
        wait_until(
            lambda: pg_conn.execute(waiting, (older.info.backend_pid,)).fetchone() == ("Lock",),
            message="the older fence to wait on the newer one",
        )
        newer.commit()
        thread.join(timeout=10)
    finally:
        newer.close()
        older.close()

    assert [StaleToken] == [type(exc) for exc in outcome]
    assert 6 == fenced(pg_conn, db, "report")


def test_superseded_holder_cannot_write_through_fence(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """A holder whose session ended is superseded: the successor writes, the old token is stale."""
    old = granted(acquire(db, claim(job, "2026-11-29"), "session", None))
    terminate(pg_conn, old.connection.info.backend_pid)
    new = granted(acquire(db, claim(job, "2026-11-29"), "session", None))

    with new.connection.transaction():
        fence(new.connection, "daily_rollup", new.token, tables=db.tables)
    with pytest.raises(StaleToken), db.connection() as conn:
        fence(conn, "daily_rollup", old.token, tables=db.tables)

    assert new.token == fenced(pg_conn, db, "daily_rollup")
    release(db, new, SUCCEEDED)
    release(db, old, SUCCEEDED)


def test_fence_without_tables_uses_the_current_apps_empty_table_prefix(
    pg_dsn: str, pglock_schema: str, pg_conn: Conn
) -> None:
    """``pglock_table_prefix = ""`` (tables named ``runs``, ``fences``, …): ``fence()``
    without ``tables=`` finds the tables the current app configures, as the CLI does."""
    app = Celery("fenced", set_as_current=False)
    app.conf.update(pglock_dsn=pg_dsn, pglock_schema=pglock_schema, pglock_table_prefix="")
    with open_database(Settings(dsn=pg_dsn, schema=pglock_schema, table_prefix="")):
        pass  # creates the un-prefixed tables, as `celery pglock migrate` would
    previous = current_app._get_current_object()  # type: ignore[attr-defined]
    app.set_current()
    try:
        with pg_conn.transaction():
            fence(pg_conn, "report", 7)
    finally:
        previous.set_current()
        app.close()

    tables = Tables(pglock_schema, "")
    row = pg_conn.execute(tables.render("SELECT token FROM {fences}")).fetchone()
    assert (7,) == row
