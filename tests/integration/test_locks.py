"""Advisory locks: exclusion within and across processes, keys, holders that vanish."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import psycopg
import pytest
from psycopg import sql

from celery_pglock import _keys as keys
from celery_pglock import signals
from celery_pglock._config import Settings
from celery_pglock._keys import lock_key
from celery_pglock._ledger import SUCCEEDED
from celery_pglock._locks import acquire, release
from celery_pglock._protocol import Lease, Released, Skip
from celery_pglock._runs import give_back_failed
from celery_pglock._values import Scope
from celery_pglock.errors import LockLost
from celery_pglock.store._database import Database
from tests.fixtures.procs import wait_until
from tests.integration.locking import (
    Conn,
    advisory_locks_of,
    claim,
    granted,
    lease_within,
    lock_holders,
    open_database,
    skipped,
    terminate,
    the_run,
)

pytestmark = pytest.mark.integration

SLOT = "2026-11-29T18:05:00Z"
# Published vectors of celery_pglock._keys (tests/unit/test_keys.py): other tools rely on them.
VECTORS = [
    ("proj:tasks.cleanup", 8934421795825505009),
    ("a", -3848465438864589366),
    ("ünïcödé:task", -4963551108530766703),
]


@pytest.fixture
def db(pg_dsn: str, pglock_schema: str) -> Iterator[Database]:
    """The library on this test\'s schema (tables created on open), closed after."""
    with open_database(Settings(dsn=pg_dsn, schema=pglock_schema)) as database:
        yield database


def documented_key_sql() -> str:
    """The SQL formula from the ``celery_pglock._keys`` docstring, as a bound query."""
    doc = keys.__doc__ or ""
    found = re.search(r"^\s*(SELECT .*);\s*$", doc, re.MULTILINE)
    assert found, "celery_pglock._keys documents no SQL formula"
    return found.group(1).replace(":name", "%(name)s")


@pytest.mark.parametrize(("name", "key"), VECTORS)
def test_documented_sql_formula_gives_the_lock_key(pg_conn: Conn, name: str, key: int) -> None:
    """The server, running the documented formula, computes lock_key() for each vector."""
    row = pg_conn.execute(documented_key_sql(), {"name": name}).fetchone()

    assert (key, key) == (row[0] if row else None, lock_key(name))


def test_granted_lock_is_in_pg_locks_under_its_key(db: Database, pg_conn: Conn, job: str) -> None:
    """A granted lock shows in pg_locks as the bigint advisory lock of lock_key(name)."""
    lease = granted(acquire(db, claim(job), "session", None))

    held = pg_conn.execute(
        "SELECT (classid::bigint << 32) | objid::bigint FROM pg_locks "
        "WHERE locktype = 'advisory' AND granted AND pid = %s",
        (lease.connection.info.backend_pid,),
    ).fetchall()

    assert [(lock_key(job),)] == held  # the (classid, objid) halves make up the signed key
    release(db, lease, SUCCEEDED)


def test_two_executions_in_one_process_never_share_a_session(db: Database, job: str) -> None:
    """Session locks are re-entrant, so a second execution here must still be refused."""
    first = granted(acquire(db, claim(job, None, "t-1"), "session", None))

    second = skipped(acquire(db, claim(job, None, "t-2"), "session", None))

    assert "locked" == second.reason
    assert second.holder is not None
    assert "t-1" == second.holder["task_id"]
    release(db, first, SUCCEEDED)


def test_concurrent_threads_get_the_lock_once(db: Database, pg_conn: Conn, job: str) -> None:
    """Threads of one process racing for one lock: exactly one is granted."""
    racers = 4
    start = threading.Barrier(racers)
    outcomes: list[Lease | Skip] = []

    def race(index: int) -> None:
        start.wait()
        outcomes.append(acquire(db, claim(job, SLOT, f"t-{index}"), "session", None))

    threads = [threading.Thread(target=race, args=(i,)) for i in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)

    leases = [outcome for outcome in outcomes if isinstance(outcome, Lease)]
    assert 1 == len(leases)
    assert ["locked"] * (racers - 1) == [o.reason for o in outcomes if isinstance(o, Skip)]
    assert [leases[0].connection.info.backend_pid] == lock_holders(pg_conn, job)
    release(db, leases[0], SUCCEEDED)


def test_released_connection_returns_to_the_pool_without_locks(
    pg_dsn: str, pglock_schema: str, pg_conn: Conn, job: str
) -> None:
    """After release the pooled connection, reused next, holds no advisory lock."""
    with open_database(Settings(dsn=pg_dsn, schema=pglock_schema, pool_size=1)) as db:
        lease = granted(acquire(db, claim(job, SLOT), "session", None))
        backend = lease.connection.info.backend_pid
        release(db, lease, SUCCEEDED)

        with db.connection() as conn:
            assert backend == conn.info.backend_pid
            assert 0 == advisory_locks_of(pg_conn, backend)


@pytest.mark.parametrize("extra", ["same", "other"])
@pytest.mark.parametrize("scope", ["session", "transaction"])
def test_locks_the_body_took_on_its_connection_end_with_the_execution(
    db: Database, pg_conn: Conn, job: str, scope: Scope, extra: str
) -> None:
    """Locks a body takes on self.pglock.connection (even re-entrantly) do not outlive it."""
    with open_database(replace(db.settings, pool_size=1)) as single:
        lease = granted(acquire(single, claim(job, SLOT), scope, None))
        name = job if extra == "same" else f"{job}:nested"
        lease.connection.execute("SELECT pg_advisory_lock(%s)", (lock_key(name),))

        release(single, lease, SUCCEEDED)

        with single.connection() as conn:
            assert 0 == advisory_locks_of(pg_conn, conn.info.backend_pid)
        assert [] == lock_holders(pg_conn, name)


def test_connection_returned_on_error_path_is_unlocked(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """A lease given back without release (error path) is reset: its lock is freed."""
    lease = granted(acquire(db, claim(job, SLOT), "session", None))
    backend = lease.connection.info.backend_pid

    give_back_failed(db, lease)  # putconn(clean=False): the pool's reset (in its worker) unlocks

    wait_until(lambda: advisory_locks_of(pg_conn, backend) == 0, message="the reset to unlock")
    release(db, granted(acquire(db, claim(job, SLOT), "session", None)), SUCCEEDED)


def test_terminated_holder_frees_the_lock_at_once(db: Database, pg_conn: Conn, job: str) -> None:
    """Ending the holder's session frees its lock: the next claimer runs attempt 2."""
    holder = granted(acquire(db, claim(job, SLOT, "t-1"), "session", None))

    terminate(pg_conn, holder.connection.info.backend_pid)

    successor = granted(acquire(db, claim(job, SLOT, "t-2"), "session", None))
    assert successor.token > holder.token
    assert 2 == successor.attempts
    release(db, successor, SUCCEEDED)


def test_terminated_holder_learns_it_lost_and_cannot_overwrite_successor(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """A holder whose session ended reports lost on release and leaves the successor's row."""
    lost: list[dict[str, Any]] = []

    def on_lost(**event: Any) -> None:
        lost.append(event)

    signals.lock_lost.connect(on_lost, weak=False)
    try:
        holder = granted(acquire(db, claim(job, SLOT, "t-1"), "session", None))
        terminate(pg_conn, holder.connection.info.backend_pid)
        successor = granted(acquire(db, claim(job, SLOT, "t-2"), "session", None))

        released = release(db, holder, SUCCEEDED)
    finally:
        signals.lock_lost.disconnect(on_lost)

    assert Released(recorded=False, lost=True) == released
    assert holder.lost
    assert [(job, SLOT, holder.token)] == [(e["lock"], e["slot"], e["token"]) for e in lost]
    row = the_run(pg_conn, db, job, SLOT)
    assert ("running", successor.token, "t-2") == (row["state"], row["token"], row["task_id"])
    release(db, successor, SUCCEEDED)


def test_terminated_holder_records_outcome_on_a_fresh_connection(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """With nobody taking over, a holder whose session ended still records its success."""
    holder = granted(acquire(db, claim(job, SLOT, "t-1"), "session", None))
    terminate(pg_conn, holder.connection.info.backend_pid)

    released = release(db, holder, SUCCEEDED)

    row = the_run(pg_conn, db, job, SLOT)
    assert Released(recorded=True, lost=True) == released
    assert ("succeeded", holder.token) == (row["state"], row["token"])
    assert [] == lock_holders(pg_conn, job)


def test_terminated_holder_check_raises_lock_lost(db: Database, pg_conn: Conn, job: str) -> None:
    """check() asks the server: after the session ended it raises LockLost."""
    holder = granted(acquire(db, claim(job, None), "session", None))
    terminate(pg_conn, holder.connection.info.backend_pid)

    with pytest.raises(LockLost, match="was lost"):
        holder.check()

    assert holder.lost
    release(db, holder, SUCCEEDED)


def test_lock_held_by_another_process_is_seen_as_locked(
    pg_dsn: str, db: Database, pg_conn: Conn, job: str
) -> None:
    """A lock taken by any other session (another replica, a tool) excludes our claim."""
    pg_conn.execute("SELECT pg_advisory_lock(%s)", (lock_key(job),))

    skip = skipped(acquire(db, claim(job, SLOT), "session", None))

    assert "locked" == skip.reason
    pg_conn.execute("SELECT pg_advisory_unlock(%s)", (lock_key(job),))
    lease = lease_within(db, claim(job, SLOT), timeout=5, message="the lock to be free")
    release(db, lease, SUCCEEDED)


def test_a_holder_is_labelled_before_it_takes_its_lock(db: Database, pg_conn: Conn) -> None:
    """A message refused while the holder's grant is still running names the holder from
    its session's label (its holder row is not committed yet). Seen in make test: the
    label came after the grant (and its look at ``row_locks``), and a SKIPPED result
    named no holder. The window lies inside one function call, which nothing outside can
    pause, so the installed function's order is what is pinned here."""
    grant_lock = db.settings.tables.table("grant_lock").as_string(pg_conn)
    [(body,)] = pg_conn.execute(
        "SELECT pg_get_functiondef(%s::regprocedure)",
        (
            f"{grant_lock}(bigint[], integer[], boolean, text, text, text, text, text, text, "
            "integer, integer)",
        ),
    ).fetchall()
    label = body.index("label_session")
    assert label < body.index("try_lock_any"), body
    assert label < body.index("pg_try_advisory"), body


def test_a_refused_grant_leaves_the_session_s_label_as_it_was(
    db: Database, pg_dsn: str, job: str
) -> None:
    lease = granted(acquire(db, claim(job, SLOT), "session", None))
    grant_lock = db.settings.tables.table("grant_lock")
    with psycopg.connect(pg_dsn, autocommit=True) as other:
        other.execute("SET application_name = 'an idle session'")
        other.execute(
            sql.SQL(
                "SELECT * FROM {}(%s, NULL, false, NULL, 'pglock 1 refused host', %s, %s, "
                "'refused', 'host', 1, 1)"
            ).format(grant_lock),
            ([lock_key(job)], job, SLOT),
        ).fetchall()
        [(label,)] = other.execute("SELECT current_setting('application_name')").fetchall()
    assert "an idle session" == label
    assert not release(db, lease, SUCCEEDED).lost
