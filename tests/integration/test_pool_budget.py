"""A process's connections: closed when idle, never while they hold a lock; a server
that refuses more (a role's connection limit) is waited out on the process's own."""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack

import psycopg
import pytest
from psycopg import sql

from celery_pglock._config import Settings
from celery_pglock._ledger import SUCCEEDED
from celery_pglock._locks import acquire, release
from celery_pglock.errors import ServerFull
from celery_pglock.schema import statement
from tests.fixtures.pg import fresh_schema, started_embedded
from tests.fixtures.procs import wait_until
from tests.integration.locking import Conn, claim, granted, lock_holders, open_database
from tests.integration.test_pool_handover import run_threads

pytestmark = pytest.mark.integration

IDLE = 0.5  # the tests' pglock_idle_timeout


def alive(pg_conn: Conn, pids: set[int]) -> set[int]:
    rows = pg_conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE pid = ANY(%s)", (list(pids),)
    ).fetchall()
    return {row[0] for row in rows}


def test_idle_connections_are_closed_after_the_idle_timeout(
    pg_dsn: str, pglock_schema: str, pg_conn: Conn
) -> None:
    """Three connections used at once, given back: all three closed once idle."""
    settings = Settings(dsn=pg_dsn, schema=pglock_schema, pool_size=3, idle_timeout=IDLE)
    with open_database(settings) as db:
        conns = [db.getconn() for _ in range(3)]
        pids = {conn.info.backend_pid for conn in conns}
        for conn in conns:
            db.putconn(conn, clean=True)
        assert 3 == db.pool.size

        wait_until(lambda: not alive(pg_conn, pids), timeout=30, message="idle ones closed")
        assert 0 == db.pool.size
        with db.connection() as again:  # a new one is opened when needed
            assert again.info.backend_pid not in pids


def test_a_held_lock_outlives_the_idle_timeout(
    pg_dsn: str, pglock_schema: str, pg_conn: Conn, job: str
) -> None:
    """A run holding its lock far longer than the idle timeout keeps it; an idle
    connection beside it is closed meanwhile."""
    settings = Settings(dsn=pg_dsn, schema=pglock_schema, pool_size=2, idle_timeout=IDLE)
    with open_database(settings) as db:
        lease = granted(acquire(db, claim(job, "s"), "session", None))
        holder = lease.connection.info.backend_pid
        with db.connection() as other:
            idle = other.info.backend_pid

        wait_until(lambda: not alive(pg_conn, {idle}), timeout=30, message="the idle one closed")
        time.sleep(IDLE * 2)  # the holder idles (between statements) past the timeout too

        assert [holder] == lock_holders(pg_conn, job)
        assert release(db, lease, SUCCEEDED).recorded
        assert 1 == db.pool.size  # the holder's, idle until its own timeout


def test_a_role_limit_is_waited_out_on_the_process_own_connections(
    plain_role: str, pg_conn: Conn, pglock_schema: str, job: str
) -> None:
    """A role allowed 2 connections, 8 threads each holding a lock 0.3 s on a pool of 8:
    all run on the two connections, none fails."""
    role = sql.Identifier(str(psycopg.conninfo.conninfo_to_dict(plain_role)["user"]))
    pg_conn.execute(
        sql.SQL("GRANT USAGE, CREATE ON SCHEMA {} TO {}").format(
            sql.Identifier(pglock_schema), role
        )
    )
    settings = Settings(dsn=plain_role, schema=pglock_schema, pool_size=8, connect_timeout=2.0)
    with open_database(settings) as db:
        pg_conn.execute(sql.SQL("ALTER ROLE {} CONNECTION LIMIT 2").format(role))
        backends: set[int] = set()

        def hold(number: int) -> None:
            lease = granted(acquire(db, claim(f"{job}-{number}"), "session", None))
            backends.add(lease.connection.info.backend_pid)
            time.sleep(0.3)
            release(db, lease, SUCCEEDED)

        errors = run_threads(8, hold)

    assert [] == errors
    assert len(backends) <= 2


def test_waiters_are_served_in_order(pg_dsn: str, pglock_schema: str) -> None:
    """A pool of one: callers queued one after another get the connection in that order."""
    settings = Settings(dsn=pg_dsn, schema=pglock_schema, pool_size=1, connect_timeout=10.0)
    with open_database(settings) as db:
        first = db.getconn()
        served: list[int] = []

        def wait_turn(number: int) -> None:
            conn = db.getconn()
            served.append(number)
            db.putconn(conn, clean=True)

        threads = []
        for number in range(5):
            thread = threading.Thread(target=wait_turn, args=(number,))
            thread.start()
            threads.append(thread)
            wait_until(lambda n=number: db.pool.waiters == n + 1, timeout=10, message="queued")
        db.putconn(first, clean=True)
        for thread in threads:
            thread.join(30)

    assert [0, 1, 2, 3, 4] == served


def test_the_server_last_slots_are_left_to_other_clients() -> None:
    """With fewer than pglock_spare_connections slots left, a process holding no connection
    takes none (ServerFull after pglock_connect_timeout); with one more free, it does."""
    with started_embedded() as server:
        server.set_config(max_connections=12)  # 12 - 3 reserved for superusers: 9 for all
        server.restart()
        with fresh_schema(server.dsn) as schema:
            settings = Settings(dsn=server.dsn, schema=schema, connect_timeout=1.0)
            with open_database(settings) as db, ExitStack() as others:
                # Other clients leave 4 slots (the test's fixtures hold none on this server).
                while free_slots(server.dsn) > 4:
                    others.enter_context(psycopg.connect(server.dsn, autocommit=True))

                with pytest.raises(ServerFull, match="pglock_spare_connections"):
                    db.getconn()
                assert 0 == db.pool.size

                others.close()  # the other clients leave (their sessions end a moment later)
                wait_until(lambda: free_slots(server.dsn) == 9, timeout=10, message="all free")
                conn = db.getconn()
                db.putconn(conn, clean=True)
                assert 1 == db.pool.size


def free_slots(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(statement("free_connection_slots")).fetchone()
    assert row is not None
    return int(row[0]) + 1  # this look-up's own session is free again after it
