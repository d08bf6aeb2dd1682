"""The rows lock backend (``pglock_lock_backend = "rows"``) on a real PostgreSQL.

Asked for by the setting here, so that a direct connection runs it; the PgBouncer tiers
(tests/faults/test_pgbouncer.py, tests/acceptance/test_behind_pooler.py) run it where it is
chosen by itself. A frozen holder is one whose heartbeat stopped (``unwatch``); the real
SIGSTOP is the acceptance test's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import psycopg
import pytest

from celery_pglock import _controls as controls
from celery_pglock import advisory_lock, fence, ops
from celery_pglock._config import Settings
from celery_pglock._heartbeat import unwatch
from celery_pglock._keys import lock_key
from celery_pglock._ledger import SUCCEEDED
from celery_pglock._locks import acquire, release
from celery_pglock._row_hold import RowHold
from celery_pglock.errors import DatabaseUnavailable, LockLost, StaleToken
from celery_pglock.store._database import Database
from celery_pglock.store.statements import OnConnection
from tests.fixtures.procs import wait_until
from tests.integration.locking import (
    Conn,
    claim,
    granted,
    lock_holders,
    open_database,
    skipped,
    the_run,
)

pytestmark = pytest.mark.integration

SLOT = "2026-12-07T03:00:00Z"
LEASE = 2.0  # seconds: short, so that an expiry comes soon; renewed every 0.67 s


@pytest.fixture
def db(pg_dsn: str, pglock_schema: str) -> Iterator[Database]:
    """The library on rows, on this test's schema."""
    settings = Settings(dsn=pg_dsn, schema=pglock_schema, lock_backend="rows")
    with open_database(settings) as database:
        yield database


@pytest.fixture
def advisory_db(pg_dsn: str, pglock_schema: str) -> Iterator[Database]:
    """The library on advisory locks, same schema: the other half of a mixed fleet."""
    settings = Settings(dsn=pg_dsn, schema=pglock_schema, lock_backend="advisory")
    with open_database(settings) as database:
        yield database


def row_locks(conn: Conn, db: Database, name: str) -> list[dict[str, Any]]:
    query = db.tables.render(
        "SELECT token, task_id, expires_at > now() AS live FROM {row_locks} "
        "WHERE lock_name = %(n)s ORDER BY token"
    )
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        return cur.execute(query, {"n": name}).fetchall()


def expires_at(conn: Conn, db: Database, name: str) -> Any:
    query = db.tables.render("SELECT expires_at FROM {row_locks} WHERE lock_name = %(n)s")
    row = conn.execute(query, {"n": name}).fetchone()
    return row[0] if row else None


def waits_then_gets(name: str, options: dict[str, Any], let_go: Callable[[], object]) -> bool:
    """Whether ``advisory_lock(name, wait=True)`` in a thread waits while the lock is held
    (a second) and gets it once ``let_go`` freed it."""
    got = threading.Event()

    def waiter() -> None:
        with advisory_lock(name, wait=True, timeout=30, **options) as handle:
            if handle.acquired:
                got.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    waited = not got.wait(1.0)  # still held: waiting
    let_go()
    thread.join(30)
    return waited and got.is_set()


def test_a_lock_on_rows_is_a_row_not_a_session_lock(db: Database, pg_conn: Conn, job: str) -> None:
    """Granted: one unexpired row with the run's token and task id, and no session holds
    the advisory lock (a transaction pooler would have left it on a shared connection)."""
    lease = granted(acquire(db, claim(job, SLOT, "t-1"), "session", LEASE))

    assert isinstance(lease.lock_session, RowHold)
    assert [{"token": lease.token, "task_id": "t-1", "live": True}] == row_locks(pg_conn, db, job)
    assert [] == lock_holders(pg_conn, job)
    assert ("running", None) == (
        the_run(pg_conn, db, job, SLOT)["state"],
        the_run(pg_conn, db, job, SLOT)["backend_pid"],
    )
    release(db, lease, SUCCEEDED)
    assert [] == row_locks(pg_conn, db, job)


def test_a_held_lock_on_rows_skips_a_second_claim_naming_its_holder(db: Database, job: str) -> None:
    """A second claim skips as ``locked`` and names the holder's task; after the release
    the slot is ``done`` and a new slot is granted with a larger token."""
    lease = granted(acquire(db, claim(job, SLOT, "t-1"), "session", LEASE))

    skip = skipped(acquire(db, claim(job, SLOT, "t-2"), "session", LEASE))
    assert ("locked", "t-1") == (skip.reason, (skip.holder or {}).get("task_id"))

    assert release(db, lease, SUCCEEDED).recorded
    assert "done" == skipped(acquire(db, claim(job, SLOT, "t-3"), "session", LEASE)).reason
    later = granted(acquire(db, claim(job, "2026-12-07T04:00:00Z"), "session", LEASE))
    assert later.token > lease.token
    release(db, later, SUCCEEDED)


def test_a_live_holder_keeps_its_lock_on_rows_past_its_lease(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """The heartbeat renews the row every third of the lease: after three renewals (more
    than a lease) a claim still skips as ``locked``."""
    lease = granted(acquire(db, claim(job, SLOT), "session", LEASE))
    seen = [expires_at(pg_conn, db, job)]

    def renewed() -> bool:
        now = expires_at(pg_conn, db, job)
        if now != seen[-1]:
            seen.append(now)
        return len(seen) > 3

    wait_until(renewed, timeout=10 * LEASE, message="three renewals")
    assert "locked" == skipped(acquire(db, claim(job, SLOT), "session", LEASE)).reason
    assert not release(db, lease, SUCCEEDED).lost


def test_a_frozen_holder_on_rows_is_taken_over_and_fenced_out(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """A holder that stops renewing loses the lock once its lease ran out: a new claim is
    granted with a larger token, the old holder's check raises ``LockLost``, its fenced
    write after the new holder's is refused, and its release records nothing."""
    frozen = granted(acquire(db, claim(job, SLOT, "t-frozen"), "session", LEASE))
    unwatch(frozen)  # its heartbeat stops, as in a SIGSTOP

    def taken_over() -> Any:
        outcome = acquire(db, claim(job, SLOT, "t-new"), "session", LEASE)
        return None if outcome.__class__.__name__ == "Skip" else outcome

    new = wait_until(taken_over, timeout=LEASE + 5, message="the takeover")
    assert new.token > frozen.token
    with pg_conn.transaction():
        fence(pg_conn, job, new.token, tables=db.tables)
    with pytest.raises(StaleToken), pg_conn.transaction():
        fence(pg_conn, job, frozen.token, tables=db.tables)
    with pytest.raises(LockLost):
        frozen.check()
    assert (False, True) == (
        release(db, frozen, SUCCEEDED).recorded,
        release(db, new, SUCCEEDED).recorded,
    )
    assert new.token == the_run(pg_conn, db, job, SLOT)["token"]


def test_a_renewal_waits_for_a_claim_in_flight_on_its_key(
    db: Database, pg_dsn: str, job: str
) -> None:
    """A claim holds the key's advisory lock from its look at the row to its commit; a
    renewal waits for it, so the two never interleave (else a renewal begun before the
    expiry could commit after a claimer saw the row expired: two holders). While the
    claim's transaction lasts, the renewal fails and is tried again, the lock not lost."""
    lease = granted(acquire(db, claim(job, SLOT), "session", LEASE))
    unwatch(lease)
    hold = lease.lock_session
    assert isinstance(hold, RowHold)
    with psycopg.connect(pg_dsn) as claimer:  # a claim in flight: its transaction open
        claimer.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key(job),))
        with pytest.raises(DatabaseUnavailable):
            hold.ping()
    hold.ping()  # the claim ended: renewed
    assert not release(db, lease, SUCCEEDED).lost


def test_a_crashed_holder_on_rows_frees_its_lock_when_its_lease_runs_out(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """A holder that vanished without a release (no heartbeat, no statement) holds the
    lock until its lease ran out, not for ever: then the slot is claimed again."""
    gone = granted(acquire(db, claim(job, SLOT), "session", LEASE))
    unwatch(gone)
    assert "locked" == skipped(acquire(db, claim(job, SLOT), "session", LEASE)).reason
    wait_until(
        lambda: not any(row["live"] for row in row_locks(pg_conn, db, job)),
        timeout=LEASE + 5,
        message="the row to expire",
    )
    retried = granted(acquire(db, claim(job, SLOT), "session", LEASE))
    assert 2 == the_run(pg_conn, db, job, SLOT)["attempts"]
    release(db, retried, SUCCEEDED)


def test_the_two_backends_exclude_each_other_on_one_key(
    db: Database, advisory_db: Database, job: str
) -> None:
    """A fleet half behind a pooler: a lock held on rows skips an advisory claim, and a
    lock held on an advisory lock skips a claim on rows."""
    on_rows = granted(acquire(db, claim(job, SLOT), "session", LEASE))
    assert "locked" == skipped(acquire(advisory_db, claim(job, SLOT), "session", LEASE)).reason
    assert "locked" == skipped(acquire(advisory_db, claim(job), "transaction", LEASE)).reason
    release(db, on_rows, SUCCEEDED)

    on_advisory = granted(acquire(advisory_db, claim(job), "session", LEASE))
    assert "locked" == skipped(acquire(db, claim(job), "session", LEASE)).reason
    release(advisory_db, on_advisory, SUCCEEDED)
    release(db, granted(acquire(db, claim(job), "session", LEASE)), SUCCEEDED)


def test_concurrency_on_rows_holds_n_rows_and_skips_the_next(db: Database, job: str) -> None:
    """Under ``pglock_concurrency = 2`` two runs hold a row each; a third skips; two
    messages of one slot never run at once under two keys."""
    keys = (lock_key(job), lock_key(f"{job}#2"))
    first = granted(acquire(db, replace(claim(job, SLOT), keys=keys), "session", LEASE))
    other = "2026-12-07T04:00:00Z"
    same_slot = replace(claim(job, SLOT), keys=keys)
    assert "locked" == skipped(acquire(db, same_slot, "session", LEASE)).reason
    second = granted(acquire(db, replace(claim(job, other), keys=keys), "session", LEASE))
    assert {first.claim.key, second.claim.key} == set(keys)
    third = replace(claim(job, "2026-12-07T05:00:00Z"), keys=keys)
    assert "locked" == skipped(acquire(db, third, "session", LEASE)).reason
    release(db, first, SUCCEEDED)
    release(db, second, SUCCEEDED)


def test_status_and_release_show_and_free_a_holder_on_rows(
    db: Database, pg_conn: Conn, pglock_schema: str, job: str
) -> None:
    """``status`` and ``why`` show a holder on rows as an advisory one (who, slot, token,
    since) and say it is on rows; ``release`` deletes its row, and the holder learns at
    its check."""
    lease = granted(acquire(db, claim(job, SLOT, "t-ops"), "session", LEASE))
    statements = OnConnection(pg_conn, db.tables)

    found = [e for e in ops.status(statements, namespace=pglock_schema).locks if e["lock"] == job]
    who = found[0]["holder"]
    assert ("session", "t-ops", SLOT, lease.token, "rows", None) == (
        who["scope"],
        who["task_id"],
        who["slot"],
        who["token"],
        who["lock_backend"],
        who["backend_pid"],
    )
    [holder] = ops.holders(statements, job)
    assert ("t-ops", "rows") == (holder["task_id"], holder["lock_backend"])
    target = controls.Target(db.tables, pglock_schema, "alice")
    found_why = controls.why(statements, target, lock_name=job, slot=SLOT, entry=None)
    assert ("t-ops", lease.token) == (found_why["holder"]["task_id"], found_why["run"]["token"])

    done = ops.force_release(statements, job)
    assert done is not None
    assert (True, 1) == (done.released, len(done.terminated))
    assert [] == ops.holders(statements, job)
    with pytest.raises(LockLost):
        lease.check()
    release(db, lease, SUCCEEDED)


def test_a_wait_on_rows_polls_until_the_holder_releases(
    db: Database, pg_dsn: str, pglock_schema: str, job: str
) -> None:
    """``advisory_lock(wait=True)`` on rows (no server lock queue): it waits while the lock
    is held and gets it once released; with a timeout that runs out it skips naming the
    holder."""
    lease = granted(acquire(db, claim(job, None, "t-holder"), "session", LEASE))
    options: dict[str, Any] = {"dsn": pg_dsn, "schema": pglock_schema, "lease": LEASE}
    options["lock_backend"] = "rows"
    with advisory_lock(job, wait=True, timeout=0.5, **options) as short:
        assert not short.acquired
        assert short.skip is not None
        assert "t-holder" == (short.skip.holder or {}).get("task_id")

    assert waits_then_gets(job, options, lambda: release(db, lease, SUCCEEDED))


def test_a_redelivery_of_a_message_whose_attempt_died_runs_once_its_lease_ran_out(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """D12 (chaos seed 2612, behind PgBouncer): a worker's pool process is SIGKILLed in a
    run and the broker redelivers the message (``acks_late``) within the lease. Its own
    dead attempt's row still holds the lock: the redelivery skipped itself as ``locked``
    and the work was lost (advisory locks free a dead holder's at once). It runs once the
    row expired, as attempt 2."""
    dead = granted(acquire(db, claim(job, SLOT, "t-redelivered"), "session", LEASE))
    unwatch(dead)  # SIGKILLed: no renewal, no release

    again = granted(acquire(db, claim(job, SLOT, "t-redelivered"), "session", LEASE))

    assert (2, again.token) == (
        the_run(pg_conn, db, job, SLOT)["attempts"],
        the_run(pg_conn, db, job, SLOT)["token"],
    )
    release(db, again, SUCCEEDED)


def test_a_redelivery_of_a_message_whose_attempt_lives_is_skipped(db: Database, job: str) -> None:
    """The other side of D12: the broker redelivers a message whose attempt is alive (a
    Redis visibility timeout shorter than the run): its row is renewed, so the copy is
    skipped as ``locked``, naming its own task id as the holder, within a renewal."""
    alive = granted(acquire(db, claim(job, SLOT, "t-long"), "session", LEASE))

    skip = skipped(acquire(db, claim(job, SLOT, "t-long"), "session", LEASE))

    assert ("locked", "t-long") == (skip.reason, (skip.holder or {}).get("task_id"))
    assert not release(db, alive, SUCCEEDED).lost


def test_an_advisory_wait_for_a_lock_held_on_rows_waits_and_leaves_no_lock_behind(
    db: Database, pg_conn: Conn, pg_dsn: str, pglock_schema: str, job: str
) -> None:
    """A fleet half behind a pooler: ``advisory_lock(wait=True)`` on advisory locks, the
    lock held on rows. The server's lock queue lets the waiter through (no session holds
    the key), its grant refuses (a row holds it): it polls instead, leaves no advisory
    lock on a pooled session (the holder on rows keeps renewing), and gets the lock once
    released."""
    on_rows = granted(acquire(db, claim(job, None, "t-rows"), "session", LEASE))
    options: dict[str, Any] = {"dsn": pg_dsn, "schema": pglock_schema, "lease": LEASE}
    options["lock_backend"] = "advisory"
    with advisory_lock(job, wait=True, timeout=0.5, **options) as short:
        assert (False, "locked") == (short.acquired, short.skip.reason if short.skip else None)
    assert [] == lock_holders(pg_conn, job)
    on_rows.lock_session.ping()  # renewed: nothing holds the key's advisory lock

    assert waits_then_gets(job, options, lambda: release(db, on_rows, SUCCEEDED))
