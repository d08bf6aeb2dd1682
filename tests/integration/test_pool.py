"""The per-process pool: reset frees locks, no sharing, dead connections, fork safety."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from celery_pglock._config import Settings
from celery_pglock._keys import lock_key
from celery_pglock._ledger import SUCCEEDED
from celery_pglock._locks import acquire, release
from celery_pglock._protocol import Lease
from celery_pglock._row_hold import RowHold
from celery_pglock._runs import give_back_failed
from celery_pglock.errors import ConfigurationError, DatabaseUnavailable
from celery_pglock.store import _database as db_module
from celery_pglock.store._database import Database
from tests.fixtures.procs import Procs, wait_until
from tests.integration.locking import (
    Conn,
    advisory_locks_of,
    claim,
    granted,
    lock_holders,
    open_database,
    session_alive,
    terminate,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def db(pg_dsn: str, pglock_schema: str) -> Iterator[Database]:
    """A pool of one connection, so the connection a test sees next is the one it returned."""
    settings = Settings(dsn=pg_dsn, schema=pglock_schema, pool_size=1, connect_timeout=0.5)
    with open_database(settings) as database:
        yield database


def test_reset_frees_every_lock_of_a_returned_connection(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """A connection returned dirty loses all its advisory locks, re-entrant ones included."""
    conn = db.getconn()
    backend = conn.info.backend_pid
    for _ in range(2):  # re-entrant: taken twice, one unlock would not free it
        conn.execute("SELECT pg_advisory_lock(%s)", (lock_key(job),))
    conn.execute("SELECT pg_advisory_lock(%s)", (lock_key(f"{job}-other"),))

    db.putconn(conn, clean=False)

    wait_until(lambda: advisory_locks_of(pg_conn, backend) == 0, message="the reset to unlock")
    with db.connection() as again:
        assert backend == again.info.backend_pid


def test_next_user_never_inherits_a_lock(db: Database, pg_conn: Conn, job: str) -> None:
    """The connection handed out after a dirty return holds no lock when the user gets it."""
    conn = db.getconn()
    conn.execute("SELECT pg_advisory_lock(%s)", (lock_key(job),))
    db.putconn(conn, clean=False)

    with db.connection() as again:
        assert 0 == advisory_locks_of(pg_conn, again.info.backend_pid)


def test_transaction_connection_returned_on_error_path_is_kept(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """A transaction-scope connection given back mid-transaction is rolled back, reset, reused."""
    lease = granted(acquire(db, claim(job, "s"), "transaction", None))
    backend = lease.connection.info.backend_pid

    give_back_failed(db, lease)

    with db.connection() as again:
        assert backend == again.info.backend_pid
        assert 0 == advisory_locks_of(pg_conn, backend)
    assert [] == lock_holders(pg_conn, job)


def test_busy_pool_refuses_rather_than_shares(db: Database, pg_conn: Conn, job: str) -> None:
    """With every connection running a lock, a new execution fails clearly, never shares one."""
    holder = granted(acquire(db, claim(f"{job}-a"), "session", None))

    with pytest.raises(DatabaseUnavailable, match="pglock_pool_size"):
        acquire(db, claim(f"{job}-b"), "session", None)

    assert [] == lock_holders(pg_conn, f"{job}-b")
    release(db, holder, SUCCEEDED)


def test_refused_connection_is_named_rather_than_blamed_on_the_pool_size(
    plain_role: str, pg_conn: Conn, pglock_schema: str, job: str
) -> None:
    """The server refuses the pool a connection: the error gives the server's reason."""
    role = sql.Identifier(str(psycopg.conninfo.conninfo_to_dict(plain_role)["user"]))
    grant = sql.SQL("GRANT USAGE, CREATE ON SCHEMA {} TO {}")
    pg_conn.execute(grant.format(sql.Identifier(pglock_schema), role))
    settings = Settings(dsn=plain_role, schema=pglock_schema, pool_size=2, connect_timeout=0.5)
    with open_database(settings) as db:
        with db.connection():  # its one connection open: the next one is asked for below
            pass
        holder = granted(acquire(db, claim(job), "session", None))
        pg_conn.execute(sql.SQL("ALTER ROLE {} CONNECTION LIMIT 1").format(role))

        with pytest.raises(DatabaseUnavailable, match="too many connections for role") as err:
            acquire(db, claim(f"{job}-b"), "session", None)

        release(db, holder, SUCCEEDED)
    assert "pglock_pool_size" not in str(err.value)
    assert "password=pw" not in str(err.value)


def test_dead_pooled_connection_is_replaced_on_acquire(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """A pooled connection the server ended while idle is retried once on a fresh one."""
    with db.connection() as conn:
        idle_backend = conn.info.backend_pid
    terminate(pg_conn, idle_backend)

    lease = granted(acquire(db, claim(job), "session", None))

    assert idle_backend != lease.connection.info.backend_pid
    assert [lease.connection.info.backend_pid] == lock_holders(pg_conn, job)
    release(db, lease, SUCCEEDED)


FORK_CHILD = textwrap.dedent(
    """
    import os, sys, time
    from celery_pglock._config import Settings
    from celery_pglock.store._database import database
    from celery_pglock._keys import lock_key
    from celery_pglock._protocol import Claim
    from celery_pglock._locks import acquire

    settings = Settings(dsn=os.environ["DSN"], schema=os.environ["SCHEMA"])
    parent = database(settings)
    name = os.environ["LOCK"]
    lease = acquire(parent, Claim(name, lock_key(name), None, "parent", "t"), "session", None)
    print("PARENT", lease.connection.info.backend_pid, flush=True)
    child = os.fork()
    if child == 0:
        db = database(settings)
        with db.connection() as conn:
            print("CHILD", int(db is parent), conn.info.backend_pid, flush=True)
        db.close()
        sys.exit(0)  # a normal exit: finalizers run, the inherited pool must stay untouched
    os.waitpid(child, 0)
    print("CHILD-EXITED", flush=True)
    time.sleep(60)  # keep the parent's session (and its lock) until the test stops us
    """
)


def test_forked_child_gets_its_own_pool_and_leaves_parents_lock(
    procs: Procs, db: Database, pg_conn: Conn, job: str
) -> None:
    """After fork the child opens its own sessions; its exit does not free the parent's lock."""
    env = {"DSN": db.settings.dsn, "SCHEMA": db.settings.schema, "LOCK": job}
    proc = procs.python("-c", FORK_CHILD, env=env)
    proc.wait_for_log("CHILD-EXITED")

    lines = dict(line.split(" ", 1) for line in proc.log_text().splitlines() if " " in line)
    parent_backend = int(lines["PARENT"])
    same_pool, child_backend = (int(x) for x in lines["CHILD"].split())
    assert (0, True) == (same_pool, parent_backend != child_backend)
    assert session_alive(pg_conn, parent_backend)
    assert [parent_backend] == lock_holders(pg_conn, job)


def test_a_process_keeps_what_its_parent_found_of_a_transaction_pooler(
    pg_dsn: str, pglock_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's start-up check found a transaction pooler at this DSN (``check_server``):
    a pool opened afterwards in the process, or in a child it forks, holds session-scope
    locks on rows without checking again (a child's own check may miss it while its
    siblings start at once), and refuses them where advisory locks were asked for."""
    monkeypatch.setattr(db_module, "_pooled_dsns", {pg_dsn})  # as check_server leaves it
    with open_database(Settings(dsn=pg_dsn, schema=pglock_schema)) as db:
        assert (True, True) == (db.transaction_pooled, db.on_rows)
        lease = acquire(db, claim(f"{pglock_schema}:pooled"), "session", None)
        assert isinstance(lease, Lease)
        assert isinstance(lease.lock_session, RowHold)
        release(db, lease, SUCCEEDED)
    advisory = Settings(dsn=pg_dsn, schema=pglock_schema, lock_backend="advisory")
    refused = pytest.raises(ConfigurationError, match='pglock_lock_backend = "auto"')
    with open_database(advisory) as db, refused:
        acquire(db, claim(f"{pglock_schema}:pooled"), "session", None)
