"""Helpers for the integration tier of the lock protocol: claims, pg_locks, ledger rows.

Plain functions (no fixtures): each test module builds its own ``db`` fixture with
:func:`open_database`, so these helpers stay importable from anywhere.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from celery_pglock._config import Settings
from celery_pglock._keys import lock_key, split_key
from celery_pglock._locks import acquire
from celery_pglock._protocol import Claim, Lease, Skip
from celery_pglock.store._database import Database
from tests.fixtures.procs import wait_until

Conn = psycopg.Connection[tuple[Any, ...]]
Row = dict[str, Any]


@contextmanager
def open_database(settings: Settings) -> Iterator[Database]:
    """A ``Database`` of its own (not the process-wide cache), opened and closed after."""
    db = Database(settings)
    db.open()
    try:
        yield db
    finally:
        db.close()


def claim(name: str, slot: str | None = None, task_id: str | None = None) -> Claim:
    """A claim on ``name`` (and ``slot``) by a task of this process."""
    return Claim(
        lock_name=name,
        key=lock_key(name),
        slot=slot,
        task_id=task_id or f"task-{uuid.uuid4().hex[:8]}",
        task_name="tests.locked",
        pid=os.getpid(),
    )


def granted(outcome: Lease | Skip) -> Lease:
    """``outcome`` as a ``Lease``; fails the test if the claim was skipped."""
    assert isinstance(outcome, Lease), f"expected the lock to be granted, got {outcome!r}"
    return outcome


def skipped(outcome: Lease | Skip) -> Skip:
    """``outcome`` as a ``Skip``; fails the test if the lock was granted."""
    assert isinstance(outcome, Skip), f"expected a skip, got {outcome!r}"
    return outcome


def try_lease(db: Database, attempt: Claim, lease: float | None = None) -> Lease | None:
    """One session-scope attempt: the ``Lease`` if granted, else None (for ``wait_until``)."""
    outcome = acquire(db, attempt, "session", lease)
    return outcome if isinstance(outcome, Lease) else None


def lease_within(db: Database, attempt: Claim, timeout: float, message: str) -> Lease:
    """Retry a session-scope claim until it is granted, failing after ``timeout`` seconds."""
    lease = wait_until(lambda: try_lease(db, attempt), timeout=timeout, message=message)
    assert lease is not None
    return lease


def lock_holders(conn: Conn, name: str) -> list[int]:
    """Backend pids holding the advisory lock of ``name``, as ``pg_locks`` shows them."""
    return _advisory_pids(conn, name, granted=True)


def lock_waiters(conn: Conn, name: str) -> list[int]:
    """Backend pids queued for the advisory lock of ``name`` in the server (not granted)."""
    return _advisory_pids(conn, name, granted=False)


def _advisory_pids(conn: Conn, name: str, *, granted: bool) -> list[int]:
    classid, objid = split_key(lock_key(name))
    rows = conn.execute(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted = %s "
        "AND objsubid = 1 AND classid = %s::bigint::oid AND objid = %s::bigint::oid "
        "ORDER BY pid",
        (granted, classid, objid),
    ).fetchall()
    return [row[0] for row in rows]


def advisory_locks_of(conn: Conn, backend_pid: int) -> int:
    """How many advisory locks the session ``backend_pid`` holds."""
    row = conn.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = %s", (backend_pid,)
    ).fetchone()
    assert row is not None
    return int(row[0])


def session_alive(conn: Conn, backend_pid: int) -> bool:
    row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (backend_pid,))
    return row.fetchone() == (1,)


def run_row(conn: Conn, db: Database, name: str, slot: str) -> Row | None:
    """The committed ledger row of (``name``, ``slot``), seen from ``conn``."""
    query = db.tables.render("SELECT * FROM {runs} WHERE lock_name = %(n)s AND slot = %(s)s")
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query, {"n": name, "s": slot}).fetchone()


def the_run(conn: Conn, db: Database, name: str, slot: str) -> Row:
    row = run_row(conn, db, name, slot)
    assert row is not None, f"no ledger row for ({name!r}, {slot!r})"
    return row


def skip_rows(conn: Conn, db: Database, name: str) -> list[Row]:
    """The skip log of ``name``, oldest first."""
    query = db.tables.render(
        "SELECT slot, reason, task_id, holder_task_id, host, pid FROM {skips} "
        "WHERE lock_name = %(n)s ORDER BY id"
    )
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query, {"n": name}).fetchall()


def pick(row: Row, *names: str) -> Row:
    """The given columns of ``row`` (to compare a row with an expected dict)."""
    return {name: row[name] for name in names}


def terminate(conn: Conn, backend_pid: int) -> None:
    """End a session as a DBA (or a failover) would; waits until it is gone."""
    conn.execute("SELECT pg_terminate_backend(%s)", (backend_pid,))
    wait_until(
        lambda: not session_alive(conn, backend_pid), message=f"backend {backend_pid} to end"
    )


def require_lease(db: Database) -> None:
    if not db.lease_supported:
        pytest.skip("the lease needs idle_session_timeout (PostgreSQL >= 14)")
