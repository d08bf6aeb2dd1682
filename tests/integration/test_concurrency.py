"""``pglock_concurrency = N``: up to N runs of one lock name at once, each slot still once."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from celery_pglock._config import Settings
from celery_pglock._keys import lock_key, lock_keys, slot_lock
from celery_pglock._ledger import SUCCEEDED
from celery_pglock._locks import acquire, release
from celery_pglock._protocol import Claim, Lease
from celery_pglock._values import Scope
from celery_pglock.store._database import Database
from tests.integration.locking import Conn, claim, granted, open_database, skipped, the_run

pytestmark = pytest.mark.integration

SLOTS = [f"2026-11-29T18:0{i}:00Z" for i in range(5)]


@pytest.fixture
def db(pg_dsn: str, pglock_schema: str) -> Iterator[Database]:
    """Room for four leases at once: the size "auto" depends on what ran before (a worker
    pool's size in this process)."""
    settings = Settings(dsn=pg_dsn, schema=pglock_schema, pool_size=6)
    with open_database(settings) as database:
        yield database


def limited(name: str, slot: str | None, concurrency: int = 3) -> Claim:
    """A claim on ``name`` under ``pglock_concurrency = concurrency``."""
    return dataclasses.replace(claim(name, slot), keys=lock_keys(name, concurrency))


def test_the_first_key_is_the_plain_lock_and_the_others_differ() -> None:
    """A limit of 1 is the plain lock; N keys are distinct and stable."""
    keys = lock_keys("proj:report", 3)

    assert (lock_key("proj:report"), 3) == (keys[0], len(set(keys)))
    assert keys == lock_keys("proj:report", 3)
    assert (lock_key("proj:report"),) == lock_keys("proj:report", 1)


@pytest.mark.parametrize("scope", ["session", "transaction"])
def test_n_slots_run_at_once_and_the_next_is_skipped_locked(
    db: Database, pg_conn: Conn, job: str, scope: Scope
) -> None:
    """Three slots get the three keys; a fourth finds them all held and skips `locked`,
    naming one of the holders; once one ends, the fourth runs."""
    leases = [granted(acquire(db, limited(job, slot), scope, None)) for slot in SLOTS[:3]]
    fourth = skipped(acquire(db, limited(job, SLOTS[3]), scope, None))

    assert {lease.claim.key for lease in leases} == set(lock_keys(job, 3))
    assert "locked" == fourth.reason
    assert (fourth.holder or {}).get("task_id") in {lease.claim.task_id for lease in leases}
    finish(db, leases.pop(0), scope)
    retried = granted(acquire(db, limited(job, SLOTS[3]), scope, None))
    for lease in [*leases, retried]:
        finish(db, lease, scope)
    assert "succeeded" == the_run(pg_conn, db, job, SLOTS[3])["state"]


def finish(db: Database, lease: Lease, scope: Scope) -> None:
    release(db, lease, SUCCEEDED)
    if scope == "transaction":
        lease.connection.commit()


@pytest.mark.parametrize("scope", ["session", "transaction"])
def test_one_slot_twice_at_once_runs_once(
    db: Database, pg_conn: Conn, job: str, scope: Scope
) -> None:
    """Two messages of one slot at once, with keys free for both: the second skips
    `locked` at once (it never waits on the first's uncommitted claim), the slot runs once."""
    first = granted(acquire(db, limited(job, SLOTS[0]), scope, None))
    second = skipped(acquire(db, limited(job, SLOTS[0]), scope, None))

    assert "locked" == second.reason
    finish(db, first, scope)
    row = the_run(pg_conn, db, job, SLOTS[0])
    assert (1, first.token, "succeeded") == (row["attempts"], row["token"], row["state"])
    assert "done" == skipped(acquire(db, limited(job, SLOTS[0]), scope, None)).reason


def test_holders_rows_name_the_limit(db: Database, pg_conn: Conn, job: str) -> None:
    """Each held key has its holder row, with the lock name's limit (status shows 2 of 3)."""
    leases = [granted(acquire(db, limited(job, slot), "session", None)) for slot in SLOTS[:2]]
    query = db.tables.render(
        "SELECT lock_key, concurrency FROM {holders} WHERE lock_name = %(n)s ORDER BY lock_key"
    )
    rows = pg_conn.execute(query, {"n": job}).fetchall()

    assert sorted((lease.claim.key, 3) for lease in leases) == sorted(rows)
    for lease in leases:
        release(db, lease, SUCCEEDED)


def test_a_skipped_claim_leaves_no_lock_behind(db: Database, pg_conn: Conn, job: str) -> None:
    """All keys held: the skipped claim gives back the slot's own key it took first, so a
    later message of that slot (on the same pooled session) is not kept out by it."""
    leases = [granted(acquire(db, limited(job, slot), "session", None)) for slot in SLOTS[:3]]
    skipped(acquire(db, limited(job, SLOTS[3]), "session", None))
    classid, objid = (part & 0xFFFFFFFF for part in slot_lock(job, SLOTS[3]))
    held = pg_conn.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2"
        " AND classid = %s::bigint::oid AND objid = %s::bigint::oid",
        (classid, objid),
    ).fetchone()

    assert (0,) == held
    release(db, leases[0], SUCCEEDED)
    release(db, granted(acquire(db, limited(job, SLOTS[3]), "session", None)), SUCCEEDED)
    for lease in leases[1:]:
        release(db, lease, SUCCEEDED)
