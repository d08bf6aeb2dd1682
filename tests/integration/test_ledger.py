"""Every transition of the run ledger (session scope), against a real PostgreSQL."""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import pytest

from celery_pglock._config import Settings
from celery_pglock._keys import lock_key
from celery_pglock._ledger import FAILED, SUCCEEDED, record_outcome, sweep_orphans
from celery_pglock._locks import acquire, release
from celery_pglock._protocol import Lease, Released
from celery_pglock.store._connections import HOSTNAME
from celery_pglock.store._database import Database
from celery_pglock.store.statements import OnConnection
from tests.integration.locking import (
    Conn,
    claim,
    granted,
    lock_holders,
    open_database,
    pick,
    run_row,
    skip_rows,
    skipped,
    terminate,
    the_run,
)

pytestmark = pytest.mark.integration

SLOT = "2026-11-29T18:05:00Z"


@pytest.fixture
def db(pg_dsn: str, pglock_schema: str) -> Iterator[Database]:
    """The library on this test\'s schema (tables created on open), closed after."""
    with open_database(Settings(dsn=pg_dsn, schema=pglock_schema)) as database:
        yield database


def test_claim_of_new_slot_is_first_attempt(db: Database, pg_conn: Conn, job: str) -> None:
    """Claiming a new slot grants the lock and commits a running row: attempt 1, its token."""
    lease = granted(acquire(db, claim(job, SLOT, "t-1"), "session", None))

    row = the_run(pg_conn, db, job, SLOT)
    expected = {
        "state": "running",
        "attempts": 1,
        "token": lease.token,
        "task_id": "t-1",
        "task_name": "tests.locked",
        "host": HOSTNAME,
        "pid": os.getpid(),
        "backend_pid": lease.connection.info.backend_pid,
        "finished_at": None,
    }
    assert expected == pick(row, *expected)
    assert (1, lease.token) == (lease.attempts, row["token"])
    release(db, lease, SUCCEEDED)


def test_success_marks_slot_succeeded(db: Database, pg_conn: Conn, job: str) -> None:
    """Releasing with success records state succeeded and a finish time."""
    lease = granted(acquire(db, claim(job, SLOT), "session", None))

    released = release(db, lease, SUCCEEDED)

    row = the_run(pg_conn, db, job, SLOT)
    assert Released(recorded=True, lost=False) == released
    assert ("succeeded", 1, lease.token, None) == (
        row["state"],
        row["attempts"],
        row["token"],
        row["reason"],
    )
    assert row["finished_at"] is not None


def test_failure_marks_slot_failed_with_reason(db: Database, pg_conn: Conn, job: str) -> None:
    """Releasing with failure records state failed and why."""
    lease = granted(acquire(db, claim(job, SLOT), "session", None))

    release(db, lease, FAILED, "ValueError: boom")

    row = the_run(pg_conn, db, job, SLOT)
    assert ("failed", "ValueError: boom") == (row["state"], row["reason"])
    assert row["finished_at"] is not None


def test_reclaim_after_failure_is_second_attempt_with_larger_token(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """A failed slot is not burnt: the next claim runs it as attempt 2 with a larger token."""
    first = granted(acquire(db, claim(job, SLOT, "t-1"), "session", None))
    release(db, first, FAILED, "ValueError: boom")

    second = granted(acquire(db, claim(job, SLOT, "t-2"), "session", None))

    row = the_run(pg_conn, db, job, SLOT)
    assert second.attempts == 2
    assert second.token > first.token
    expected = {"state": "running", "attempts": 2, "token": second.token, "task_id": "t-2"}
    assert expected == pick(row, *expected)
    assert (None, None) == (row["reason"], row["finished_at"])
    release(db, second, SUCCEEDED)


def test_claim_of_succeeded_slot_skips_done_with_who_ran_it(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """A duplicate after success is skipped as done, naming the run that succeeded."""
    first = granted(acquire(db, claim(job, SLOT, "t-1"), "session", None))
    release(db, first, SUCCEEDED)
    finished = the_run(pg_conn, db, job, SLOT)["finished_at"]

    skip = skipped(acquire(db, claim(job, SLOT, "t-2"), "session", None))

    assert ("done", job, SLOT, first.token) == (skip.reason, skip.lock_name, skip.slot, skip.token)
    holder = {"host": HOSTNAME, "pid": os.getpid(), "task_id": "t-1"}
    assert skip.holder is not None
    assert holder == pick(skip.holder, "host", "pid", "task_id")
    assert finished.isoformat() == skip.holder["finished"]


def test_done_skip_leaves_the_run_and_the_lock_alone(db: Database, pg_conn: Conn, job: str) -> None:
    """A done skip changes nothing in the run row and frees the lock it briefly took."""
    first = granted(acquire(db, claim(job, SLOT, "t-1"), "session", None))
    release(db, first, SUCCEEDED)
    before = the_run(pg_conn, db, job, SLOT)

    skipped(acquire(db, claim(job, SLOT, "t-2"), "session", None))

    assert before == the_run(pg_conn, db, job, SLOT)
    assert [] == lock_holders(pg_conn, job)


@pytest.mark.parametrize("slot", [SLOT, None], ids=["slot", "no-slot"])
def test_second_claimer_while_held_skips_locked_with_holder(
    db: Database, pg_conn: Conn, slot: str | None, job: str
) -> None:
    """While one execution holds the lock, another is skipped as locked, naming the holder."""
    holder = granted(acquire(db, claim(job, slot, "t-1"), "session", None))

    skip = skipped(acquire(db, claim(job, slot, "t-2"), "session", None))

    assert ("locked", holder.token) == (skip.reason, skip.token)
    assert skip.holder is not None
    expected = {"host": HOSTNAME, "pid": os.getpid(), "task_id": "t-1", "slot": slot}
    assert expected == pick(skip.holder, *expected)
    since = datetime.fromisoformat(skip.holder["since"])
    assert since <= datetime.now(timezone.utc)
    assert [holder.connection.info.backend_pid] == lock_holders(pg_conn, job)
    release(db, holder, SUCCEEDED)


def test_locked_skip_does_not_touch_the_holders_run(db: Database, pg_conn: Conn, job: str) -> None:
    """A skipped duplicate leaves the running row of the holder as it was."""
    holder = granted(acquire(db, claim(job, SLOT, "t-1"), "session", None))
    before = the_run(pg_conn, db, job, SLOT)

    skipped(acquire(db, claim(job, SLOT, "t-2"), "session", None))

    assert before == the_run(pg_conn, db, job, SLOT)
    release(db, holder, SUCCEEDED)


def test_scheduled_row_becomes_running_on_claim(db: Database, pg_conn: Conn, job: str) -> None:
    """A slot beat recorded as scheduled is claimed as attempt 1, keeping beat's columns."""
    pg_conn.execute(
        db.tables.render(
            "INSERT INTO {runs} (lock_name, slot, lock_key, state, entry, sent_by, task_name, "
            "scheduled_at) VALUES (%(name)s, %(slot)s, %(key)s, 'scheduled', 'every-5-min', "
            "'beat-a', 'tests.locked', now())"
        ),
        {"name": job, "slot": SLOT, "key": lock_key(job)},
    )

    lease = granted(acquire(db, claim(job, SLOT, "t-1"), "session", None))

    row = the_run(pg_conn, db, job, SLOT)
    expected = {
        "state": "running",
        "attempts": 1,
        "token": lease.token,
        "task_id": "t-1",
        "entry": "every-5-min",
        "sent_by": "beat-a",
    }
    assert expected == pick(row, *expected)
    assert row["scheduled_at"] is not None
    release(db, lease, SUCCEEDED)


def _beat_scheduled(pg_conn: Conn, db: Database, name: str, slot: str) -> None:
    """The row beat writes when it sends a slot's message."""
    pg_conn.execute(
        db.tables.render(
            "INSERT INTO {runs} (lock_name, slot, lock_key, state, entry, sent_by, task_name, "
            "scheduled_at) VALUES (%(name)s, %(slot)s, %(key)s, 'scheduled', 'every-5-min', "
            "'beat-a', 'tests.locked', now())"
        ),
        {"name": name, "slot": slot, "key": lock_key(name)},
    )


def test_a_scheduled_slot_whose_message_is_skipped_is_final_skipped(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """Beat sent the slot, its message is skipped ``locked`` (an older slot of the lock
    still runs): nothing else will run it, so its row is final, ``skipped`` with why."""
    older = granted(acquire(db, claim(job, "2026-11-29T18:00:00Z", "t-old"), "session", None))
    _beat_scheduled(pg_conn, db, job, SLOT)

    skip = skipped(acquire(db, claim(job, SLOT, "t-new"), "session", None))

    row = the_run(pg_conn, db, job, SLOT)
    assert ("locked", "skipped", "locked") == (skip.reason, row["state"], row["reason"])
    assert row["finished_at"] is not None
    release(db, older, SUCCEEDED)


def test_a_skipped_slot_still_runs_on_its_next_message(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """``skipped`` is final for the message that was skipped, not for the slot: a later
    message of it (a redelivery) claims it like a failed one."""
    older = granted(acquire(db, claim(job, "2026-11-29T18:00:00Z", "t-old"), "session", None))
    _beat_scheduled(pg_conn, db, job, SLOT)
    skipped(acquire(db, claim(job, SLOT, "t-new"), "session", None))
    release(db, older, SUCCEEDED)

    lease = granted(acquire(db, claim(job, SLOT, "t-again"), "session", None))
    release(db, lease, SUCCEEDED)

    row = the_run(pg_conn, db, job, SLOT)
    assert ("succeeded", 1, "t-again") == (row["state"], row["attempts"], row["task_id"])


def test_claim_without_slot_writes_no_run(db: Database, pg_conn: Conn, job: str) -> None:
    """A lock without a slot only excludes concurrent runs: the ledger gets no row."""
    lease = granted(acquire(db, claim(job, None), "session", None))
    release(db, lease, SUCCEEDED)

    count = pg_conn.execute(db.tables.render("SELECT count(*) FROM {runs}")).fetchone()
    assert (0,) == count
    assert lease.attempts is None


def test_skips_are_logged_with_reason_and_holder(db: Database, pg_conn: Conn, job: str) -> None:
    """Every skip appends a row: who was skipped, why, and which task held or ran the slot."""
    holder = granted(acquire(db, claim(job, SLOT, "t-1"), "session", None))
    skipped(acquire(db, claim(job, SLOT, "t-2"), "session", None))
    release(db, holder, SUCCEEDED)
    skipped(acquire(db, claim(job, SLOT, "t-3"), "session", None))

    rows = skip_rows(pg_conn, db, job)

    expected = [
        {"slot": SLOT, "reason": "locked", "task_id": "t-2", "holder_task_id": "t-1"},
        {"slot": SLOT, "reason": "done", "task_id": "t-3", "holder_task_id": "t-1"},
    ]
    assert expected == [pick(row, *expected[0]) for row in rows]
    assert {(HOSTNAME, os.getpid())} == {(row["host"], row["pid"]) for row in rows}


def test_outcome_is_recorded_when_the_body_left_a_transaction_open(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """A body that began a transaction on its lock connection and never ended it still
    gets its outcome committed (the pool would roll back anything left open)."""
    lease = granted(acquire(db, claim(job, SLOT), "session", None))
    lease.connection.execute("BEGIN")
    lease.connection.execute("SELECT 1")

    released = release(db, lease, SUCCEEDED)

    assert released.recorded
    assert "succeeded" == the_run(pg_conn, db, job, SLOT)["state"]


def test_slots_of_one_lock_are_independent(db: Database, pg_conn: Conn, job: str) -> None:
    """Success of one slot does not skip the next slot of the same lock."""
    first = granted(acquire(db, claim(job, "2026-01-01"), "session", None))
    release(db, first, SUCCEEDED)

    second = granted(acquire(db, claim(job, "2026-01-02"), "session", None))
    release(db, second, SUCCEEDED)

    states = [the_run(pg_conn, db, job, s)["state"] for s in ("2026-01-01", "2026-01-02")]
    assert ["succeeded", "succeeded"] == states
    assert run_row(pg_conn, db, job, "2026-01-03") is None


# -- rows nothing can finish: a dead attempt's `running` row becomes final -------------------

NEWER = "2026-11-29T18:06:00Z"


def dead_attempt(db: Database, pg_conn: Conn, job: str, slot: str, task_id: str) -> Lease:
    """A granted attempt whose session then ended without a word (a SIGKILLed worker)."""
    lease = granted(acquire(db, claim(job, slot, task_id), "session", None))
    [backend] = lock_holders(pg_conn, job)
    terminate(pg_conn, backend)
    return lease


def test_a_skipped_redelivery_records_the_dead_attempt_abandoned(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """The slot's row is running, its attempt's session gone, and the redelivery is skipped
    (another slot holds the lock): the skip records the dead attempt failed, abandoned."""
    dead = dead_attempt(db, pg_conn, job, SLOT, "t-dead")
    newer = granted(acquire(db, claim(job, NEWER, "t-newer"), "session", None))

    skip = skipped(acquire(db, claim(job, SLOT, "t-dead"), "session", None))

    assert "locked" == skip.reason
    row = the_run(pg_conn, db, job, SLOT)
    assert (FAILED, dead.token) == (row["state"], row["token"])
    assert row["reason"].startswith("abandoned:")
    assert row["finished_at"] is not None
    release(db, newer, SUCCEEDED)


def test_the_sweep_records_dead_attempts_abandoned_and_leaves_live_ones(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """sweep_orphans: a running row whose session is gone becomes failed; a live
    holder's running row stays running."""
    dead_attempt(db, pg_conn, job, SLOT, "t-dead")
    live = granted(acquire(db, claim(f"{job}-live", SLOT, "t-live"), "session", None))

    with db.connection() as conn:
        swept = sweep(conn, db)

    assert [(job, SLOT)] == [(row["lock_name"], row["slot"]) for row in swept]
    assert FAILED == the_run(pg_conn, db, job, SLOT)["state"]
    assert "running" == the_run(pg_conn, db, f"{job}-live", SLOT)["state"]
    release(db, live, SUCCEEDED)


def test_an_abandoned_slot_runs_again_with_a_larger_token(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """Abandoned is failed: the next attempt claims the slot as attempt 2."""
    dead = dead_attempt(db, pg_conn, job, SLOT, "t-dead")
    with db.connection() as conn:
        sweep(conn, db)

    again = granted(acquire(db, claim(job, SLOT, "t-again"), "session", None))

    assert (2, True) == (again.attempts, again.token > dead.token)
    release(db, again, SUCCEEDED)


def test_an_attempt_alive_past_its_session_still_records_its_outcome(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """The sweep ran between the attempt's connection breaking and its recovery write:
    the same token may still record success (no later attempt took the slot)."""
    dead = dead_attempt(db, pg_conn, job, SLOT, "t-1")
    with db.connection() as conn:
        sweep(conn, db)

    recorded = record_outcome(db, dead.claim, dead.token, SUCCEEDED, None)

    assert recorded
    assert SUCCEEDED == the_run(pg_conn, db, job, SLOT)["state"]


def sweep(conn: Conn, db: Database) -> list[dict[str, Any]]:
    """The beat leader's sweep of rows whose attempt died, run on ``conn``."""
    return sweep_orphans(OnConnection(conn, db.tables).rows)
