"""The lease: the server takes the lock from a holder that stops responding.

A session-scope holder's lock connection has ``idle_session_timeout`` set to the lease
while it runs, and a heartbeat keeps it busy; a frozen holder goes idle and the server
ends its session, freeing the lock. These tests freeze real processes (SIGSTOP).
"""

from __future__ import annotations

import os
import textwrap
import threading
import time
from collections.abc import Iterator

import pytest

from celery_pglock._config import Settings
from celery_pglock._heartbeat import heartbeat
from celery_pglock._ledger import SUCCEEDED
from celery_pglock._locks import acquire, release
from celery_pglock._protocol import Lease, Released
from celery_pglock.errors import LockLost
from celery_pglock.store._database import Database
from tests.fixtures.procs import Procs, wait_until
from tests.integration.locking import (
    Conn,
    advisory_locks_of,
    claim,
    granted,
    lease_within,
    lock_holders,
    open_database,
    require_lease,
    skipped,
    terminate,
    the_run,
)

# Run alone (serial): leases of a second or two. Its bounds are guarantees, not speeds: a quiet
# holder loses its lock within the lease (lease + 1 s: the server ends the session at the
# lease, the successor's next try follows); the heartbeat's CPU seconds while it must be
# idle stay under 0.3 s (a busy loop burns about a second: load only lowers CPU seconds).
pytestmark = [pytest.mark.integration, pytest.mark.serial]

SLOT = "2026-11-29T18:05:00Z"

HOLDER = textwrap.dedent(
    """
    import os, time
    from celery_pglock._config import Settings
    from celery_pglock.store._database import database
    from celery_pglock.errors import LockLost
    from celery_pglock._keys import lock_key
    from celery_pglock._protocol import Claim
    from celery_pglock._locks import acquire, release
    from celery_pglock._protocol import Lease

    db = database(Settings(dsn=os.environ["DSN"], schema=os.environ["SCHEMA"]))
    name, slot = os.environ["LOCK"], os.environ["SLOT"]
    claim = Claim(name, lock_key(name), slot, "holder", "tests.holder", pid=os.getpid())
    lease = acquire(db, claim, "session", float(os.environ["LEASE"]))
    assert isinstance(lease, Lease), lease
    print("HELD", lease.token, flush=True)
    while not lease.lost:  # a long task body that checks its lock now and then
        try:
            lease.check()
        except LockLost:
            pass
        time.sleep(0.05)
    print("LOST", lease.lost, flush=True)
    released = release(db, lease, "succeeded")
    print(f"RELEASED recorded={released.recorded} lost={released.lost}", flush=True)
    time.sleep(60)
    """
)


@pytest.fixture
def db(pg_dsn: str, pglock_schema: str) -> Iterator[Database]:
    """The library on this test\'s schema (tables created on open), closed after."""
    with open_database(Settings(dsn=pg_dsn, schema=pglock_schema)) as database:
        require_lease(database)
        yield database


def test_frozen_holder_loses_lock_within_lease_and_learns_it(
    procs: Procs, db: Database, pg_conn: Conn, job: str
) -> None:
    """A SIGSTOPped holder's lock is free within lease + 1 s; after SIGCONT it sees it lost."""
    lease_seconds = 2.0
    env = {"DSN": db.settings.dsn, "SCHEMA": db.settings.schema, "LOCK": job, "SLOT": SLOT}
    holder = procs.python("-c", HOLDER, env={**env, "LEASE": str(lease_seconds)})
    holder.wait_for_log("HELD")
    holder_token = int(holder.log_text().split("HELD ", 1)[1].split()[0])

    holder.freeze()
    successor = lease_within(
        db,
        claim(job, SLOT, "successor"),
        timeout=lease_seconds + 1,
        message="the frozen holder's lock to be freed by the server",
    )

    assert successor.token > holder_token
    assert 2 == successor.attempts
    holder.thaw()
    holder.wait_for_log("LOST True")
    holder.wait_for_log("RELEASED recorded=False lost=True")
    row = the_run(pg_conn, db, job, SLOT)
    assert ("running", successor.token) == (row["state"], row["token"])
    release(db, successor, SUCCEEDED)
    assert "succeeded" == the_run(pg_conn, db, job, SLOT)["state"]


def test_heartbeat_keeps_a_long_holder_alive(db: Database, pg_conn: Conn, job: str) -> None:
    """A holder running well past its lease, without freezing, keeps its lock."""
    lease = granted(acquire(db, claim(job, SLOT, "t-1"), "session", 1.5))
    armed = lease.connection.execute("SHOW idle_session_timeout").fetchone()
    started = time.monotonic()

    wait_until(
        lambda: lease.last_ping - started >= 3.0,
        timeout=6,
        message="the heartbeat to ping two leases after the grant",
    )

    assert ("1500ms",) == armed
    assert not lease.lost
    assert [lease.connection.info.backend_pid] == lock_holders(pg_conn, job)
    lease.check()
    assert "locked" == skipped(acquire(db, claim(job, SLOT, "t-2"), "session", None)).reason
    assert release(db, lease, SUCCEEDED).recorded


def test_holder_without_heartbeat_loses_lock_after_lease(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """The server ends a lease holder that goes quiet; the lock is free, check() says lost."""
    lease = granted(acquire(db, claim(job, SLOT, "t-1"), "session", 1.0))
    heartbeat().unregister(lease)  # as if the holder froze

    successor = lease_within(
        db,
        claim(job, SLOT, "t-2"),
        timeout=2,
        message="the server to end the quiet holder",
    )

    with pytest.raises(LockLost):
        lease.check()
    assert successor.token > lease.token
    release(db, successor, SUCCEEDED)
    assert not release(db, lease, SUCCEEDED).recorded


def test_transaction_scope_holder_without_heartbeat_loses_lock(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """A transaction-scope holder idle in its transaction past the lease is ended too."""
    lease = granted(acquire(db, claim(job, SLOT, "t-1"), "transaction", 1.0))
    heartbeat().unregister(lease)

    successor = lease_within(
        db,
        claim(job, SLOT, "t-2"),
        timeout=2,
        message="the server to end the idle transaction",
    )

    with pytest.raises(LockLost):
        lease.check()
    assert 1 == successor.attempts  # the quiet holder's claim rolled back with its session
    release(db, successor, SUCCEEDED)


def test_transaction_scope_holder_ended_by_lease_reports_lost_on_release(
    db: Database, job: str
) -> None:
    """Releasing after the server ended an idle transaction says lost, not a driver error."""
    lease = granted(acquire(db, claim(job, SLOT, "t-1"), "transaction", 1.0))
    heartbeat().unregister(lease)
    successor = lease_within(
        db,
        claim(job, SLOT, "t-2"),
        timeout=2,
        message="the server to end the idle transaction",
    )

    released = release(db, lease, SUCCEEDED)

    assert Released(recorded=False, lost=True) == released
    release(db, successor, SUCCEEDED)


def test_heartbeat_does_not_spin_while_a_transaction_body_is_busy(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """While the body's own query runs past the lease, the heartbeat waits, not busy-loops."""
    lease = granted(acquire(db, claim(job, SLOT), "transaction", 0.6))
    cpu_before = heartbeat_cpu_seconds()

    lease.connection.execute("SELECT pg_sleep(1.2)")

    assert heartbeat_cpu_seconds() - cpu_before < 0.3
    assert not lease.lost
    release(db, lease, SUCCEEDED)


def test_heartbeat_does_not_spin_on_a_lost_lease(db: Database, pg_conn: Conn, job: str) -> None:
    """Once a lease is lost and not yet released, the heartbeat thread goes quiet."""
    lease = granted(acquire(db, claim(job, SLOT), "session", 0.6))
    pg_conn.execute("SELECT pg_terminate_backend(%s)", (lease.connection.info.backend_pid,))
    wait_until(lambda: lease.lost, timeout=3, message="the heartbeat to notice the loss")
    cpu_before = heartbeat_cpu_seconds()

    wait_until(
        lambda: time.monotonic() - lease.last_ping > 1.0,
        timeout=3,
        message="a second with the lost lease still registered",
    )

    assert heartbeat_cpu_seconds() - cpu_before < 0.3
    release(db, lease, SUCCEEDED)


def test_release_disarms_the_lease_of_the_pooled_connection(
    pg_dsn: str, pglock_schema: str, pg_conn: Conn, job: str
) -> None:
    """After release the pooled connection may idle forever: its idle timeout is restored."""
    with open_database(Settings(dsn=pg_dsn, schema=pglock_schema, pool_size=1)) as db:
        default = db.idle_defaults["idle_session_timeout"]
        lease = granted(acquire(db, claim(job, SLOT), "session", 1.0))
        release(db, lease, SUCCEEDED)

        with db.connection() as conn:
            setting = conn.execute("SELECT current_setting('idle_session_timeout')").fetchone()
            assert lease.connection.info.backend_pid == conn.info.backend_pid
    assert (default,) == setting


def test_done_skip_disarms_the_lease_it_armed(
    pg_dsn: str, pglock_schema: str, pg_conn: Conn, job: str
) -> None:
    """A claim that took the lock and armed a lease, then found the slot done, leaves neither."""
    with open_database(Settings(dsn=pg_dsn, schema=pglock_schema, pool_size=1)) as db:
        default = db.idle_defaults["idle_session_timeout"]
        release(db, granted(acquire(db, claim(job, SLOT), "session", None)), SUCCEEDED)
        assert "done" == skipped(acquire(db, claim(job, SLOT), "session", 1.0)).reason

        with db.connection() as conn:
            setting = conn.execute("SELECT current_setting('idle_session_timeout')").fetchone()
            locks = advisory_locks_of(pg_conn, conn.info.backend_pid)
    assert ((default,), 0) == (setting, locks)


def heartbeat_cpu_seconds() -> float:
    """CPU time used so far by this process's heartbeat thread (from /proc)."""
    thread_id = heartbeat()._thread.native_id
    stat = open(f"/proc/self/task/{thread_id}/stat").read()  # noqa: SIM115
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_check_waits_for_a_ping_in_flight_and_then_asks_the_server(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """check() while the heartbeat holds the connection (both wake after a thaw): it does
    not answer "held" unasked, it waits and asks the server, which ended the session."""
    lease = granted(acquire(db, claim(job, SLOT, "t-1"), "session", 30.0))
    [backend] = lock_holders(pg_conn, job)
    outcome: list[BaseException | None] = []

    with lease.connection.lock:  # the heartbeat's ping, in flight
        terminate(pg_conn, backend)  # meanwhile the server ended the session (the lease ran out)
        checker = threading.Thread(target=lambda: outcome.append(_checked(lease)))
        checker.start()
        checker.join(timeout=0.5)  # it must be waiting on the connection, not answering
        assert [] == outcome
    checker.join(timeout=10)

    assert [LockLost] == [type(found) for found in outcome]
    assert lease.lost
    release(db, lease, SUCCEEDED)


def test_lost_asks_the_server_when_the_heartbeat_has_not_heard_from_it(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """``lost`` after longer than the lease without a word from the server (a freeze whose
    heartbeat has not run yet) asks the server instead of answering "held"."""
    lease = granted(acquire(db, claim(job, SLOT, "t-1"), "session", 2.0))
    heartbeat().unregister(lease)  # the heartbeat has not run since the thaw
    [backend] = lock_holders(pg_conn, job)
    terminate(pg_conn, backend)
    lease.confirmed -= 3.0  # its last word from the server predates the freeze

    assert lease.lost
    release(db, lease, SUCCEEDED)


def _checked(lease: Lease) -> BaseException | None:
    try:
        lease.check()
    except LockLost as exc:
        return exc
    return None
