"""A lock without a slot is released unwaited; a process reuses its last connection.

A session-scope run without a slot has no outcome to record, so its release statement is
sent and not waited for: the run costs one round trip. The reply is read when the
connection is next taken. These tests stop, end and watch real server sessions.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from celery_pglock import _locks as locks
from celery_pglock._config import Settings
from celery_pglock._ledger import SUCCEEDED
from celery_pglock._locks import acquire, release
from celery_pglock._protocol import Released
from celery_pglock.store import _unwaited as unwaited
from celery_pglock.store._database import Database
from tests.fixtures.procs import wait_until
from tests.integration.locking import (
    Conn,
    claim,
    granted,
    lock_holders,
    open_database,
    terminate,
)

pytestmark = pytest.mark.integration

ACTIVE = psycopg.pq.TransactionStatus.ACTIVE


@pytest.fixture
def db(pg_dsn: str, pglock_schema: str) -> Iterator[Database]:
    with open_database(Settings(dsn=pg_dsn, schema=pglock_schema, pool_size=2)) as database:
        yield database


@pytest.fixture
def other(db: Database) -> Iterator[Database]:
    """The library as another process would hold it: its own pool."""
    with open_database(db.settings) as database:
        yield database


def test_release_without_slot_returns_before_its_reply(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """The release is in flight when it returns; the server frees the lock on reading it."""
    lease = granted(acquire(db, claim(job), "session", 5.0))
    backend = lease.connection.info.backend_pid

    released = release(db, lease, SUCCEEDED)

    assert Released(recorded=False, lost=False) == released
    assert ACTIVE == lease.connection.info.transaction_status  # reply not read yet
    wait_until(lambda: lock_holders(pg_conn, job) == [], message="the server to free the lock")
    again = granted(acquire(db, claim(job), "session", 5.0))
    assert backend == again.connection.info.backend_pid  # its reply read, then reused
    release(db, again, SUCCEEDED)


def test_release_with_slot_waits_for_its_outcome(db: Database, pg_conn: Conn, job: str) -> None:
    """A slot's outcome must be recorded before the task returns: that release is waited."""
    lease = granted(acquire(db, claim(job, "2026-11-29"), "session", 5.0))

    assert release(db, lease, SUCCEEDED).recorded

    assert psycopg.pq.TransactionStatus.IDLE == lease.connection.info.transaction_status
    assert [] == lock_holders(pg_conn, job)


def test_session_ended_before_the_reply_was_read_costs_only_that_connection(
    db: Database, pg_conn: Conn, job: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The server process ends before it answers the release: the connection is replaced
    when next taken, its session's end freed the lock, the next run goes ahead."""
    lease = granted(acquire(db, claim(job), "session", 5.0))
    backend = lease.connection.info.backend_pid
    os.kill(backend, signal.SIGSTOP)  # the release waits unread in its socket
    try:
        release(db, lease, SUCCEEDED)
        pg_conn.execute("SELECT pg_terminate_backend(%s)", (backend,))
    finally:
        os.kill(backend, signal.SIGCONT)  # it handles the termination first
    wait_until(lambda: lock_holders(pg_conn, job) == [], message="the session to end")

    with caplog.at_level(logging.INFO, logger="celery_pglock"):
        again = granted(acquire(db, claim(job), "session", 5.0))

    assert backend != again.connection.info.backend_pid
    assert "pglock_unwaited_reply_failed" in [getattr(r, "action", "") for r in caplog.records]
    release(db, again, SUCCEEDED)


def test_release_after_the_server_ended_the_session_is_waited_and_reports_the_loss(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """The server said something (it ended the session): the release waits and learns."""
    lease = granted(acquire(db, claim(job), "session", 5.0))
    terminate(pg_conn, lease.connection.info.backend_pid)
    wait_until(lambda: not unwaited.quiet(lease.connection), message="the server's goodbye")

    released = release(db, lease, SUCCEEDED)

    assert Released(recorded=False, lost=True) == released
    assert lease.lost
    release(db, granted(acquire(db, claim(job), "session", 5.0)), SUCCEEDED)


def test_claim_tries_once_more_before_skipping_a_holder_whose_release_is_in_flight(
    db: Database, other: Database, pg_conn: Conn, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The holder's server process reads its release only after another process's first
    try failed: the second try, a round trip later, gets the lock."""
    holder = granted(acquire(db, claim(job, task_id="holder"), "session", 5.0))
    backend = holder.connection.info.backend_pid
    os.kill(backend, signal.SIGSTOP)  # its server process cannot read the release yet
    tries: list[bool] = []
    real_try = locks._try_lock

    def try_then_thaw(*args: Any) -> Any:
        session, row = real_try(*args)
        tries.append(bool(row["acquired"]))
        if len(tries) == 1:
            os.kill(backend, signal.SIGCONT)
            wait_until(lambda: lock_holders(pg_conn, job) == [], message="the release to land")
        return session, row

    try:
        release(db, holder, SUCCEEDED)
        monkeypatch.setattr(locks, "_try_lock", try_then_thaw)
        successor = granted(acquire(other, claim(job, task_id="successor"), "session", 5.0))
    finally:
        os.kill(backend, signal.SIGCONT)

    assert [False, True] == tries
    release(other, successor, SUCCEEDED)


def test_runs_one_after_another_use_one_connection(db: Database, pg_conn: Conn, job: str) -> None:
    """With two pooled connections, sequential runs still stay on the last one used."""
    first, second = db.getconn(), db.getconn()  # the pool now holds two
    db.putconn(first, clean=True)
    db.putconn(second, clean=True)

    backends = set()
    for number in range(6):
        slot = None if number % 2 else f"slot-{number}"
        lease = granted(acquire(db, claim(job, slot), "session", 5.0))
        backends.add(lease.connection.info.backend_pid)
        release(db, lease, SUCCEEDED)

    assert 1 == len(backends)
    assert backends <= {first.info.backend_pid, second.info.backend_pid}
