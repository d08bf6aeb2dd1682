"""Coalescing policies of the lock protocol: ``superseded`` and ``late`` skips.

A claim with ``coalesce`` is skipped when a newer time slot of its lock (and beat entry)
already succeeded or is running; one with ``max_lateness`` when its time slot is older
than that. Checked in the same statement as the lock, against a real PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from celery_pglock._config import Settings
from celery_pglock._ledger import SUCCEEDED
from celery_pglock._locks import acquire, release
from celery_pglock._protocol import Claim, Lease
from celery_pglock._slots import format_slot
from celery_pglock._values import Scope
from celery_pglock.store._database import Database
from tests.integration.locking import (
    Conn,
    claim,
    granted,
    open_database,
    run_row,
    skip_rows,
    skipped,
    terminate,
)

pytestmark = pytest.mark.integration

OLDER = "2026-11-29T18:05:00Z"
NEWER = "2026-11-29T18:06:00Z"
ENTRY = "cleanup-every-minute"


@pytest.fixture
def db(pg_dsn: str, pglock_schema: str) -> Iterator[Database]:
    """The library on this test's schema (tables created on open), closed after."""
    with open_database(Settings(dsn=pg_dsn, schema=pglock_schema)) as database:
        yield database


def beat_claim(name: str, slot: str, task_id: str, *, entry: str = ENTRY) -> Claim:
    """A claim as the worker makes it for a message beat sent: coalescing on."""
    return replace(claim(name, slot, task_id), entry=entry, coalesce=True)


def run(db: Database, attempt: Claim, scope: Scope = "session") -> Lease:
    """Run ``attempt`` to success."""
    lease = granted(acquire(db, attempt, scope, None))
    release(db, lease, SUCCEEDED)  # transaction scope: commits the claim and the outcome
    return lease


def seconds_ago(seconds: float) -> str:
    return format_slot(datetime.now(timezone.utc) - timedelta(seconds=seconds))


@pytest.mark.parametrize("scope", ["session", "transaction"])
def test_slot_older_than_a_succeeded_one_is_superseded(
    db: Database, job: str, scope: Scope
) -> None:
    """After a newer slot succeeded, an older one is SKIPPED 'superseded', naming that run."""
    newer = run(db, beat_claim(job, NEWER, "t-new"), scope)

    skip = skipped(acquire(db, beat_claim(job, OLDER, "t-old"), scope, None))

    assert ("superseded", newer.token) == (skip.reason, skip.token)
    assert skip.holder is not None
    assert ("t-new", NEWER) == (skip.holder["task_id"], skip.holder["slot"])


def test_superseded_slot_is_logged_and_not_claimed(db: Database, pg_conn: Conn, job: str) -> None:
    """The superseded message is in the skips log and leaves no running row behind."""
    run(db, beat_claim(job, NEWER, "t-new"))

    skipped(acquire(db, beat_claim(job, OLDER, "t-old"), "session", None))

    [row] = skip_rows(pg_conn, db, job)
    assert (OLDER, "superseded", "t-old", "t-new") == (
        row["slot"],
        row["reason"],
        row["task_id"],
        row["holder_task_id"],
    )
    assert run_row(pg_conn, db, job, OLDER) is None


def test_slot_older_than_the_running_one_is_superseded(db: Database, job: str) -> None:
    """While a newer slot runs, an older one is SKIPPED 'superseded' (not 'locked')."""
    running = granted(acquire(db, beat_claim(job, NEWER, "t-new"), "session", None))

    skip = skipped(acquire(db, beat_claim(job, OLDER, "t-old"), "session", None))
    release(db, running, SUCCEEDED)

    assert skip.reason == "superseded"
    assert skip.holder is not None
    assert ("t-new", NEWER) == (skip.holder["task_id"], skip.holder["slot"])


def test_newer_slot_runs_after_an_older_one(db: Database, job: str) -> None:
    """Coalescing only looks forward: the next slot runs after the previous succeeded."""
    run(db, beat_claim(job, OLDER, "t-old"))

    lease = granted(acquire(db, beat_claim(job, NEWER, "t-new"), "session", None))

    release(db, lease, SUCCEEDED)


def test_without_coalescing_an_older_slot_runs(db: Database, job: str) -> None:
    """pglock_coalesce='all': an older slot still runs after a newer one succeeded."""
    run(db, beat_claim(job, NEWER, "t-new"))

    lease = granted(acquire(db, claim(job, OLDER, "t-old"), "session", None))

    release(db, lease, SUCCEEDED)


def test_newer_slot_of_another_entry_does_not_supersede(db: Database, job: str) -> None:
    """Two beat entries sharing a lock do not supersede each other's slots."""
    run(db, beat_claim(job, NEWER, "t-new", entry="nightly"))

    lease = granted(acquire(db, beat_claim(job, OLDER, "t-old"), "session", None))

    release(db, lease, SUCCEEDED)


def test_slots_that_are_not_times_are_never_superseded(db: Database, job: str) -> None:
    """Business-key slots do not sort in time: coalescing leaves them alone."""
    run(db, beat_claim(job, "batch-9", "t-9"))

    lease = granted(acquire(db, beat_claim(job, "batch-10", "t-10"), "session", None))

    release(db, lease, SUCCEEDED)


def test_newer_run_whose_holder_died_does_not_supersede(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """A newer slot left 'running' by a dead holder is not running: the older slot runs."""
    dead = granted(acquire(db, beat_claim(job, NEWER, "t-new"), "session", None))
    terminate(pg_conn, dead.connection.info.backend_pid)

    lease = granted(acquire(db, beat_claim(job, OLDER, "t-old"), "session", None))

    release(db, lease, SUCCEEDED)


def test_slot_older_than_max_lateness_is_late(db: Database, pg_conn: Conn, job: str) -> None:
    """A time slot 120 s old with pglock_max_lateness=60 is SKIPPED 'late', not claimed."""
    slot = seconds_ago(120)
    attempt = replace(claim(job, slot, "t-late"), max_lateness=60.0)

    skip = skipped(acquire(db, attempt, "session", None))

    assert (skip.reason, skip.holder) == ("late", None)
    assert ["late"] == [row["reason"] for row in skip_rows(pg_conn, db, job)]
    assert run_row(pg_conn, db, job, slot) is None


def test_slot_within_max_lateness_runs(db: Database, job: str) -> None:
    """A time slot 5 s old with pglock_max_lateness=60 runs."""
    attempt = replace(claim(job, seconds_ago(5), "t-fresh"), max_lateness=60.0)

    release(db, granted(acquire(db, attempt, "session", None)), SUCCEEDED)


def test_lateness_ignores_slots_that_are_not_times(db: Database, job: str) -> None:
    """A business-key slot is never late."""
    attempt = replace(claim(job, "2020-01-01", "t-day"), max_lateness=1.0)

    release(db, granted(acquire(db, attempt, "session", None)), SUCCEEDED)


def test_done_wins_over_superseded_and_late(db: Database, job: str) -> None:
    """A duplicate of a slot that succeeded is reported 'done', whatever else applies."""
    old = seconds_ago(120)
    run(db, beat_claim(job, old, "t-1"))
    run(db, beat_claim(job, seconds_ago(0), "t-2"))
    duplicate = replace(beat_claim(job, old, "t-3"), max_lateness=60.0)

    skip = skipped(acquire(db, duplicate, "session", None))

    assert skip.reason == "done"
    assert skip.holder is not None
    assert "t-1" == skip.holder["task_id"]


def test_superseded_wins_over_late(db: Database, job: str) -> None:
    """Both apply: the reason is 'superseded' (it names the newer run)."""
    run(db, beat_claim(job, seconds_ago(0), "t-new"))
    stale = replace(beat_claim(job, seconds_ago(120), "t-old"), max_lateness=60.0)

    assert "superseded" == skipped(acquire(db, stale, "session", None)).reason
