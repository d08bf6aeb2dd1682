"""Connections given back reach callers already waiting for the pool (threads, greenlets).

A process whose tasks run as threads holds more locks at once than its pool has
connections: the callers beyond it block in the pool's ``getconn()``. These tests check
that each connection given back goes to one of them at once, so none waits out the
connect timeout while others finish (before, a parked connection was invisible to them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from celery_pglock._config import Settings
from celery_pglock._ledger import SUCCEEDED
from celery_pglock._locks import acquire, release
from celery_pglock.errors import DatabaseUnavailable
from celery_pglock.store._database import Database, close_all, database, pool_size, size_for_worker
from tests.integration.locking import Conn, claim, granted, lock_holders, open_database

pytestmark = pytest.mark.integration

# Far above the wait of a caller served as connections are given back (a few times the
# 0.3 s a lock is held), far below what a stuck caller would wait (forever).
CONNECT_TIMEOUT = 3.0
JOIN_TIMEOUT = 60.0  # a thread still running then is stuck: the test fails, saying so


def run_threads(count: int, body: Callable[[int], None]) -> list[BaseException]:
    """Run ``body(i)`` in ``count`` threads started together; the exceptions they raised."""
    errors: list[BaseException] = []
    start = threading.Barrier(count)

    def run(number: int) -> None:
        try:
            start.wait()
            body(number)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_TIMEOUT)
    stuck = [thread.name for thread in threads if thread.is_alive()]
    assert [] == stuck, f"threads still running after {JOIN_TIMEOUT:g} s"
    return errors


@pytest.mark.parametrize("slot", [None, "s"], ids=["mutex-only", "slotted"])
def test_six_holders_on_two_connections_all_run(
    pg_dsn: str, pglock_schema: str, pg_conn: Conn, job: str, slot: str | None
) -> None:
    """6 threads each holding a lock ~0.3 s on a pool of 2: all run, no DatabaseUnavailable."""
    settings = Settings(
        dsn=pg_dsn, schema=pglock_schema, pool_size=2, connect_timeout=CONNECT_TIMEOUT
    )
    tokens: dict[int, int] = {}
    backends: set[int] = set()
    with open_database(settings) as db:

        def hold(number: int) -> None:
            lease = granted(acquire(db, claim(f"{job}-{number}", slot), "session", None))
            backends.add(lease.connection.info.backend_pid)
            assert [lease.connection.info.backend_pid] == lock_holders(pg_conn, lease.lock)
            time.sleep(0.3)  # the work done under the lock; the others wait meanwhile
            release(db, lease, SUCCEEDED)
            tokens[number] = lease.token

        errors = run_threads(6, hold)

        assert [] == [exc for exc in errors if isinstance(exc, DatabaseUnavailable)]
        assert [] == errors
        assert 0 == db.pool.waiters
    assert list(range(6)) == sorted(tokens)
    # The two connections served all six: one handed over with its release reply unread
    # would have been discarded by the pool and replaced by a new session.
    assert len(backends) <= 2


def test_many_short_runs_on_a_small_pool_never_time_out(
    pg_dsn: str, pglock_schema: str, job: str
) -> None:
    """8 threads x 25 back-to-back runs on 2 connections: every run gets one, none times out."""
    settings = Settings(
        dsn=pg_dsn, schema=pglock_schema, pool_size=2, connect_timeout=CONNECT_TIMEOUT
    )
    done: list[int] = []
    with open_database(settings) as db:

        def churn(number: int) -> None:
            for round_ in range(25):
                slot = f"r{round_}" if round_ % 2 else None  # waited and unwaited releases
                lease = granted(acquire(db, claim(f"{job}-{number}", slot), "session", None))
                release(db, lease, SUCCEEDED)
                done.append(number)

        errors = run_threads(8, churn)

        assert [] == errors
        assert 0 == db.pool.waiters
    assert 8 * 25 == len(done)


def test_auto_pool_follows_the_worker_concurrency(pg_dsn: str, pglock_schema: str) -> None:
    """An "auto" pool opened before start-up grows to a thread worker's concurrency + 1."""
    settings = Settings(dsn=pg_dsn, schema=pglock_schema)
    try:
        db: Database = database(settings)
        assert 4 == db.pool.max_size

        assert 9 == size_for_worker(settings, 8)

        assert 9 == db.pool.max_size
        assert 9 == pool_size(settings)
    finally:
        size_for_worker(settings, None)
        close_all()
    assert 4 == pool_size(settings)
