"""Session-scope locks of a process whose tasks run as threads share one server session
(``celery_pglock._shared``): a handful of connections however many runs hold locks, two
runs of one lock name in the process never overlap, a session that ends loses all of its
locks and none of the rest, and a body never sees the shared session."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

from celery_pglock import ops
from celery_pglock._config import Settings
from celery_pglock._keys import lock_keys
from celery_pglock._ledger import SUCCEEDED
from celery_pglock._locks import acquire, release
from celery_pglock._protocol import Claim, Lease
from celery_pglock.cli import _output as output
from celery_pglock.errors import LockLost, ReadOnlyServer, WaitEnded
from celery_pglock.store import _database as db_module
from celery_pglock.store._database import Database
from celery_pglock.store.statements import OnConnection
from tests.fixtures.procs import wait_until
from tests.integration.locking import (
    Conn,
    advisory_locks_of,
    claim,
    granted,
    lock_holders,
    open_database,
    skip_rows,
    skipped,
    the_run,
)
from tests.integration.test_pool_budget import alive
from tests.integration.test_pool_handover import run_threads

pytestmark = pytest.mark.integration

THREADS = 50


@pytest.fixture
def db(pg_dsn: str, pglock_schema: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Database]:
    """A worker process's ``Database`` whose tasks run as ``THREADS`` threads."""
    monkeypatch.setattr(db_module, "_worker_pool_size", THREADS + 1)
    settings = Settings(dsn=pg_dsn, schema=pglock_schema, pool_size=THREADS + 1)
    with open_database(settings) as opened:
        assert opened.shares_sessions
        yield opened


def concurrent(name: str, slot: str | None = None, limit: int = 2) -> Claim:
    """A claim on ``name`` under ``pglock_concurrency = limit``."""
    return dataclasses.replace(claim(name, slot), keys=lock_keys(name, limit))


def test_runs_holding_locks_at_once_share_one_session(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """50 threads each hold a lock of its own at once: one connection, one session holds
    all 50; once all are released it holds none and idles in the pool."""
    leases: list[Lease] = []
    all_held = threading.Barrier(THREADS)
    peak: list[int] = []

    def hold(number: int) -> None:
        lease = granted(acquire(db, claim(f"{job}-{number}", "s"), "session", 30.0))
        leases.append(lease)
        all_held.wait()
        peak.append(db.pool.size)
        assert release(db, lease, SUCCEEDED).recorded

    assert [] == run_threads(THREADS, hold)
    backends = {lease.lock_connection.info.backend_pid for lease in leases}
    assert 1 == len(backends)
    assert [1] == sorted(set(peak))
    assert 0 == advisory_locks_of(pg_conn, backends.pop())
    assert (1, 1) == (db.pool.size, db.pool.idle)
    for number in range(THREADS):
        assert SUCCEEDED == the_run(pg_conn, db, f"{job}-{number}", "s")["state"]


def test_two_runs_of_one_lock_name_never_overlap_in_the_process(db: Database, job: str) -> None:
    """10 threads try one lock name 10 times each (100 tries): never two inside at once,
    though the session would grant its own lock again."""
    inside: list[int] = []
    overlaps: list[int] = []
    granted_count: list[int] = []
    guard = threading.Lock()

    def tries(number: int) -> None:
        for attempt in range(10):
            outcome = acquire(db, claim(job, f"{number}-{attempt}"), "session", 30.0)
            if not isinstance(outcome, Lease):
                continue
            with guard:
                inside.append(number)
                if len(inside) > 1:
                    overlaps.append(number)
            time.sleep(0.002)  # the run's body
            with guard:
                inside.remove(number)
                granted_count.append(number)
            release(db, outcome, SUCCEEDED)

    assert [] == run_threads(10, tries)
    assert [] == overlaps
    assert granted_count  # some got the lock, the others were skipped


def test_a_run_of_the_process_holding_the_lock_is_named_in_the_skip(
    db: Database, pg_conn: Conn, job: str
) -> None:
    holder = granted(acquire(db, claim(job, "a", task_id="the-holder"), "session", 30.0))
    skip = skipped(acquire(db, claim(job, "b"), "session", 30.0))

    assert "locked" == skip.reason
    assert skip.holder is not None
    assert ("the-holder", "a") == (skip.holder["task_id"], skip.holder["slot"])
    assert holder.token == skip.token
    rows = skip_rows(pg_conn, db, job)
    assert [("b", "the-holder")] == [(row["slot"], row["holder_task_id"]) for row in rows]
    assert release(db, holder, SUCCEEDED).recorded


def test_concurrency_keys_and_slots_on_one_session(db: Database, pg_conn: Conn, job: str) -> None:
    """pglock_concurrency = 2: two slots run at once on the session, a third waits for a
    key, and one slot twice at once runs once."""
    first = granted(acquire(db, concurrent(job, "1"), "session", 30.0))
    again = skipped(acquire(db, concurrent(job, "1"), "session", 30.0))
    second = granted(acquire(db, concurrent(job, "2"), "session", 30.0))
    third = skipped(acquire(db, concurrent(job, "3"), "session", 30.0))

    assert first.claim.key != second.claim.key
    assert ("locked", "locked") == (again.reason, third.reason)
    assert first.lock_connection is second.lock_connection
    assert release(db, first, SUCCEEDED).recorded
    fourth = granted(acquire(db, concurrent(job, "3"), "session", 30.0))
    assert release(db, second, SUCCEEDED).recorded
    assert release(db, fourth, SUCCEEDED).recorded
    assert 0 == advisory_locks_of(pg_conn, first.lock_connection.info.backend_pid)


def test_a_done_slot_frees_only_what_its_try_took(db: Database, pg_conn: Conn, job: str) -> None:
    """A duplicate of a succeeded slot gets the lock, finds the slot done and frees the
    lock: another run's lock on the session stays held."""
    assert release(db, granted(acquire(db, claim(job, "s"), "session", 30.0)), SUCCEEDED).recorded
    other = granted(acquire(db, claim(f"{job}-other", "s"), "session", 30.0))

    assert "done" == skipped(acquire(db, claim(job, "s"), "session", 30.0)).reason
    backend = other.lock_connection.info.backend_pid
    assert [backend] == lock_holders(pg_conn, f"{job}-other")
    assert [] == lock_holders(pg_conn, job)
    assert release(db, other, SUCCEEDED).recorded


def test_an_ended_session_loses_every_lock_on_it_and_the_next_run_gets_a_new_one(
    db: Database, pg_conn: Conn, job: str
) -> None:
    first = granted(acquire(db, claim(f"{job}-1", "s"), "session", 30.0))
    second = granted(acquire(db, claim(f"{job}-2", "s"), "session", 30.0))
    backend = first.lock_connection.info.backend_pid
    pg_conn.execute("SELECT pg_terminate_backend(%s)", (backend,))
    wait_until(lambda: not alive(pg_conn, {backend}), timeout=10, message="the session ended")

    with pytest.raises(LockLost):
        first.check()
    third = granted(acquire(db, claim(f"{job}-3", "s"), "session", 30.0))
    assert third.lock_connection.info.backend_pid != backend
    assert second.known_lost  # the new session's first statement found the old one gone

    for lease in (first, second):  # recorded afterwards on another connection: nobody took over
        outcome = release(db, lease, SUCCEEDED)
        assert (True, True) == (outcome.lost, outcome.recorded)
    assert release(db, third, SUCCEEDED).recorded
    assert SUCCEEDED == the_run(pg_conn, db, f"{job}-2", "s")["state"]


def test_a_body_gets_a_connection_of_its_own(db: Database, pg_conn: Conn, job: str) -> None:
    """The body's ``.connection`` is not the shared session: its transaction and its own
    advisory lock are undone at the release; the other run's lock stays."""
    lease = granted(acquire(db, claim(job, "s"), "session", 30.0))
    other = granted(acquire(db, claim(f"{job}-other", "s"), "session", 30.0))
    body = lease.connection
    assert body is not lease.lock_connection
    assert body is lease.connection  # the same one for the whole run
    body.execute("SELECT pg_advisory_lock(4242, 4242)")
    body.execute("BEGIN")
    body.execute("SELECT 1")
    backend = body.info.backend_pid

    assert release(db, lease, SUCCEEDED).recorded
    assert 0 == advisory_locks_of(pg_conn, backend)
    assert [other.lock_connection.info.backend_pid] == lock_holders(pg_conn, f"{job}-other")
    assert release(db, other, SUCCEEDED).recorded


def test_off_runs_keep_a_connection_each(
    pg_dsn: str, pglock_schema: str, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pglock_shared_sessions = False: one connection per run, as in a prefork child."""
    monkeypatch.setattr(db_module, "_worker_pool_size", THREADS + 1)
    settings = Settings(dsn=pg_dsn, schema=pglock_schema, shared_sessions=False)
    with open_database(settings) as plain:
        assert not plain.shares_sessions
        first = granted(acquire(plain, claim(f"{job}-1"), "session", 30.0))
        second = granted(acquire(plain, claim(f"{job}-2"), "session", 30.0))
        assert first.lock_connection is not second.lock_connection
        release(plain, first, SUCCEEDED)
        release(plain, second, SUCCEEDED)


def test_an_operator_ending_a_shared_session_is_told_what_else_it_frees(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """``celery pglock release`` of one lock on a shared session ends the session: the
    holder's row says how many other locks it holds, and the release frees them all."""
    first = granted(acquire(db, claim(f"{job}-1", "s"), "session", 30.0))
    second = granted(acquire(db, claim(f"{job}-2", "s"), "session", 30.0))

    [holder] = ops.holders(OnConnection(pg_conn, db.tables), f"{job}-1")
    assert 1 == holder["other_locks"]
    note = output.shared_note([holder])
    assert f"backend {holder['backend_pid']} also holds 1 other advisory locks" in note
    done = ops.force_release(OnConnection(pg_conn, db.tables), f"{job}-1")
    assert done is not None
    assert done.released
    assert [] == lock_holders(pg_conn, f"{job}-2")
    with pytest.raises(LockLost):
        second.check()
    for lease in (first, second):
        assert release(db, lease, SUCCEEDED).lost


def test_a_lock_statement_cut_short_leaves_no_lock_on_the_session(
    pg_dsn: str, pglock_schema: str, pg_conn: Conn, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DBA's statement_timeout ends a lock statement after it took the advisory lock
    (its holder row is locked by another transaction): the lock is freed on the session,
    which lives on, with the other run's lock."""
    monkeypatch.setattr(db_module, "_worker_pool_size", THREADS + 1)
    dsn = f"{pg_dsn}{'&' if '?' in pg_dsn else '?'}options=-c%20statement_timeout%3D500"
    with open_database(Settings(dsn=dsn, schema=pglock_schema)) as db:
        assert release(db, granted(acquire(db, claim(job, "a"), "session", 30.0)), SUCCEEDED)
        other = granted(acquire(db, claim(f"{job}-other", "s"), "session", 30.0))
        backend = other.lock_connection.info.backend_pid
        blocker = psycopg.connect(pg_dsn)
        try:
            query = db.tables.render("SELECT 1 FROM {holders} WHERE lock_key = %s FOR UPDATE")
            assert blocker.execute(query, (claim(job).key,)).fetchone() is not None
            with pytest.raises(WaitEnded):
                acquire(db, claim(job, "b"), "session", 30.0)
        finally:
            blocker.close()

        assert [] == lock_holders(pg_conn, job)
        assert [backend] == lock_holders(pg_conn, f"{job}-other")
        assert not other.known_lost
        assert release(db, other, SUCCEEDED).recorded


def test_a_skip_on_an_unused_session_gives_its_connection_back_disarmed(
    db: Database, job: str
) -> None:
    """A duplicate of a done slot took the lock (arming the lease) on a session no other
    run uses: its connection goes back to the pool with the lease and label put back."""
    assert release(db, granted(acquire(db, claim(job, "s"), "session", 30.0)), SUCCEEDED)
    assert "done" == skipped(acquire(db, claim(job, "s"), "session", 30.0)).reason

    assert (1, 1) == (db.pool.size, db.pool.idle)
    with db.connection() as pooled:
        assert ("0",) == pooled.execute("SHOW idle_session_timeout").fetchone()
        name = pooled.execute("SHOW application_name").fetchone()
        assert name is not None
        assert not name[0].startswith("pglock ")


def test_a_shared_session_on_a_server_that_takes_no_writes_is_ended(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """The shared session reaches a server that turned read-only (a demoted primary):
    the claim fails as ReadOnlyServer, the session is ended with its locks, and the next
    claim opens a new one (which, behind a multi-host DSN, reaches the new primary)."""
    holder = granted(acquire(db, claim(f"{job}-1", "s"), "session", 30.0))
    shared = holder.lock_connection
    shared.execute("SET default_transaction_read_only = on")  # as a demoted server answers

    with pytest.raises(ReadOnlyServer):
        acquire(db, claim(f"{job}-2", "s"), "session", 30.0)
    assert shared.closed
    assert holder.known_lost
    # The server ends the closed session's backend a moment later (under load, visibly).
    wait_until(lambda: not lock_holders(pg_conn, f"{job}-1"), timeout=10, message="freed")
    again = granted(acquire(db, claim(f"{job}-2", "s"), "session", 30.0))
    assert again.lock_connection is not shared
    assert release(db, again, SUCCEEDED).recorded
    assert release(db, holder, SUCCEEDED).lost


def test_a_new_session_goes_back_to_the_pool_while_a_lost_run_still_runs(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """The session ended under a run that has not released yet; a later run's session,
    once that run is released, goes back to the pool disarmed: the lost run is not
    counted as one of its holders."""
    first = granted(acquire(db, claim(f"{job}-1", "s"), "session", 30.0))
    backend = first.lock_connection.info.backend_pid
    pg_conn.execute("SELECT pg_terminate_backend(%s)", (backend,))
    wait_until(lambda: not alive(pg_conn, {backend}), timeout=10, message="the session ended")

    second = granted(acquire(db, claim(f"{job}-2", "s"), "session", 30.0))
    assert first.known_lost
    assert release(db, second, SUCCEEDED).recorded
    assert (1, 1) == (db.pool.size, db.pool.idle)
    with db.connection() as pooled:
        assert ("0",) == pooled.execute("SHOW idle_session_timeout").fetchone()
    assert release(db, first, SUCCEEDED).lost
