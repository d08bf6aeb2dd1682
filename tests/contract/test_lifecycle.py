"""A run's lifecycle through the library's own code (``locks.acquire``, ``runs.settle_*``,
``waiting``), on the in-memory server and on PostgreSQL alike: claim, skip, settle, give
back, ``pglock_concurrency``, ``buffer_one``'s turn, a lock lost to a terminated session
or a frozen holder's lease.
Only the server differs; every assertion must hold on both."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol

import psycopg
import pytest

from celery_pglock import ops, waiting
from celery_pglock.config import Settings
from celery_pglock.errors import LockLost
from celery_pglock.heartbeat import unwatch
from celery_pglock.keys import lock_keys, slot_lock, split_key
from celery_pglock.locks import acquire
from celery_pglock.messages import SLOT_HEADER
from celery_pglock.protocol import Claim, Lease, Skip
from celery_pglock.runs import settle_failure, settle_success
from celery_pglock.schema import Tables
from celery_pglock.store.database import Database
from celery_pglock.store.memory import InMemoryStatements
from celery_pglock.store.memory_sessions import InMemoryServer, InMemorySession, in_memory_database
from celery_pglock.store.statements import OnConnection, Statements
from celery_pglock.values import Scope
from celery_pglock.waiting import WAITED_HEADER, Message
from tests.fixtures.procs import wait_until

SLOT = "2026-12-07T10:00:00Z"
LATER = "2026-12-07T10:01:00Z"
LEASE = 1.0  # seconds: short, so that PostgreSQL ends a frozen holder soon


class Server(Protocol):
    """What a test does to the server, the same way on both."""

    def end(self, lease: Lease) -> None:
        """End the holder's session, as a DBA (or a crash of its server process) would."""

    def freeze(self, lease: Lease) -> None:
        """The holder stops answering (SIGSTOP): its lease runs out on the server."""

    def locks_held(self, lock_name: str) -> int:
        """How many advisory locks of ``lock_name`` (its keys, its slots' own) are held."""


@dataclass
class Lifecycle:
    db: Database
    statements: Statements  # to read the ledger back
    server: Server
    # A lock name of the test's own: advisory locks are the server's, not the schema's.
    lock: str = field(default_factory=lambda: f"contract:report-{uuid.uuid4().hex[:8]}")

    def claim(
        self,
        slot: str | None = SLOT,
        *,
        concurrency: int = 1,
        task_id: str | None = None,
        buffer: bool = False,
    ) -> Claim:
        """A claim of this test's lock (and ``slot``), by a task of this process."""
        keys = lock_keys(self.lock, concurrency)
        return Claim(
            lock_name=self.lock,
            key=keys[0],
            slot=slot,
            task_id=task_id or f"task-{uuid.uuid4().hex[:8]}",
            task_name="tasks.report",
            keys=keys if concurrency > 1 else (),
            buffer=buffer,
        )

    def take(
        self, found: Claim, scope: Scope = "session", lease: float | None = None
    ) -> Lease | Skip:
        return acquire(self.db, found, scope, lease)

    def run(self, slot: str | None = SLOT) -> dict[str, Any]:
        found = self.statements.row("why_run", {"lock_name": self.lock, "slot": slot})
        assert found is not None, f"no ledger row for {self.lock} {slot}"
        return found

    def skips(self, slot: str = SLOT) -> list[dict[str, Any]]:
        return self.statements.rows("why_skips", {"lock_name": self.lock, "slot": slot})

    def locks_held(self) -> int:
        return self.server.locks_held(self.lock)


class Clock:
    """A clock the test moves (the twin's ``now()`` and leases)."""

    def __init__(self) -> None:
        self.at = datetime(2026, 12, 7, 10, 0, 5, tzinfo=timezone.utc)

    def __call__(self) -> datetime:
        return self.at

    def advance(self, seconds: float) -> None:
        self.at += timedelta(seconds=seconds)


class TwinServer:
    def __init__(self, server: InMemoryServer, clock: Clock) -> None:
        self.server, self.clock = server, clock

    def end(self, lease: Lease) -> None:
        session = lease.lock_session
        assert isinstance(session, InMemorySession)
        self.server.terminate(session)

    def freeze(self, lease: Lease) -> None:
        unwatch(lease)  # no heartbeat: the holder is frozen
        self.clock.advance(LEASE * 2)

    def locks_held(self, lock_name: str) -> int:
        return sum(
            self.server.holds(session, key)
            for session in self.server.sessions()
            for key in _keys_of(lock_name)
        )


class PostgresServer:
    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    def end(self, lease: Lease) -> None:
        pid = lease.lock_connection.info.backend_pid
        self.conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        wait_until(lambda: not self._alive(pid), message=f"backend {pid} to end")

    def freeze(self, lease: Lease) -> None:
        unwatch(lease)  # no heartbeat: the holder is frozen
        pid = lease.lock_connection.info.backend_pid
        wait_until(lambda: not self._alive(pid), message=f"the lease of backend {pid} to end it")

    def locks_held(self, lock_name: str) -> int:
        held = 0
        for key in _keys_of(lock_name):
            classid, objid, subid = (*key, 2) if isinstance(key, tuple) else (*split_key(key), 1)
            query = (
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                " AND classid = %s::bigint::oid AND objid = %s::bigint::oid AND objsubid = %s"
            )
            row = self.conn.execute(query, (classid % 2**32, objid % 2**32, subid)).fetchone()
            held += int(row[0]) if row else 0
        return held

    def _alive(self, pid: int) -> bool:
        found = self.conn.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,))
        return found.fetchone() is not None


@pytest.fixture(params=["twin", pytest.param("postgres", marks=pytest.mark.integration)])
def life(request: pytest.FixtureRequest) -> Iterator[Lifecycle]:
    if request.param == "twin":
        clock = Clock()
        server = InMemoryServer(InMemoryStatements(Tables("contract"), clock=clock))
        yield Lifecycle(in_memory_database(server), server.tables, TwinServer(server, clock))
        return
    dsn: str = request.getfixturevalue("pg_dsn")
    settings = Settings(dsn=dsn, schema=request.getfixturevalue("pglock_schema"))
    ops.migrate(settings)
    db = Database(settings)
    db.open()
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            statements = OnConnection(conn, settings.tables, settings)
            yield Lifecycle(db, statements, PostgresServer(conn))
    finally:
        db.close()


def granted(outcome: Lease | Skip) -> Lease:
    assert isinstance(outcome, Lease), f"expected the lock, got {outcome!r}"
    return outcome


def skipped(outcome: Lease | Skip) -> Skip:
    assert isinstance(outcome, Skip), f"expected a skip, got {outcome!r}"
    return outcome


def test_a_claim_is_granted_with_a_token_and_its_row_running(life: Lifecycle) -> None:
    """The first claim of a slot gets the lock, attempt 1 and a token; its row is running."""
    lease = granted(life.take(life.claim(task_id="first")))

    assert (1, "running", "first") == (lease.attempts, *_pick(life.run(), "state", "task_id"))
    assert lease.token == life.run()["token"]
    settle_success(life.db, lease)


def test_a_claim_of_a_held_lock_is_skipped_naming_the_holder(life: Lifecycle) -> None:
    """A second claim while the lock is held is skipped as locked, naming the holder."""
    holder = granted(life.take(life.claim(task_id="holder")))

    skip = skipped(life.take(life.claim(LATER, task_id="second")))

    assert ("locked", "holder") == (skip.reason, (skip.holder or {}).get("task_id"))
    assert ["locked"] == [row["reason"] for row in life.skips(LATER)]
    settle_success(life.db, holder)


def test_a_succeeded_slot_is_done_for_every_later_message(life: Lifecycle) -> None:
    """Settled succeeded, the slot's row is final: a late duplicate is skipped as done."""
    settle_success(life.db, granted(life.take(life.claim(task_id="ran"))))

    skip = skipped(life.take(life.claim(task_id="late copy")))

    assert "succeeded" == life.run()["state"]
    assert ("done", "ran") == (skip.reason, (skip.holder or {}).get("task_id"))


def test_a_failed_attempt_does_not_burn_the_slot(life: Lifecycle) -> None:
    """Settled failed, the slot runs again: attempt 2, with a larger token."""
    first = granted(life.take(life.claim()))
    settle_failure(life.db, first, RuntimeError("disk full"))
    assert ("failed", "RuntimeError: disk full") == _pick(life.run(), "state", "reason")

    again = granted(life.take(life.claim()))

    assert 2 == again.attempts
    assert again.token > first.token
    settle_success(life.db, again)
    assert "succeeded" == life.run()["state"]


def test_a_released_lock_is_given_back_free(life: Lifecycle) -> None:
    """After each settle the lock is free and no lock stays held by a pooled session."""
    settle_success(life.db, granted(life.take(life.claim(SLOT))))
    settle_failure(life.db, granted(life.take(life.claim(LATER))), ValueError("bad"))
    settle_success(life.db, granted(life.take(life.claim(None))))

    assert 0 == life.locks_held()
    assert ["succeeded", "failed"] == [life.run(slot=s)["state"] for s in (SLOT, LATER)]


def test_concurrency_n_runs_n_slots_and_never_one_slot_twice(life: Lifecycle) -> None:
    """Under pglock_concurrency = 2 two slots run at once, a third waits its turn (locked),
    and a second message of a running slot is skipped, not run under the other key."""
    first = granted(life.take(life.claim(SLOT, concurrency=2)))
    copy = skipped(life.take(life.claim(SLOT, concurrency=2)))
    second = granted(life.take(life.claim(LATER, concurrency=2)))
    third = skipped(life.take(life.claim("2026-12-07T10:02:00Z", concurrency=2)))

    assert first.claim.key != second.claim.key
    assert ("locked", "locked") == (copy.reason, third.reason)
    settle_success(life.db, first)
    settle_success(life.db, second)
    assert 0 == life.locks_held()


def test_a_terminated_holder_learns_of_it_and_a_takeover_wins(life: Lifecycle) -> None:
    """The holder's session ends: a redelivery takes the slot over (a larger token); the
    old holder's success cannot stand (LockLost) and the row keeps the new attempt."""
    old = granted(life.take(life.claim(task_id="old")))
    life.server.end(old)
    new = granted(life.take(life.claim(task_id="new")))

    with pytest.raises(LockLost):
        settle_success(life.db, old)

    assert new.token > old.token
    assert (new.token, "running") == _pick(life.run(), "token", "state")
    settle_success(life.db, new)
    assert ("succeeded", "new") == _pick(life.run(), "state", "task_id")


def test_a_terminated_holder_still_records_its_outcome_when_nobody_took_over(
    life: Lifecycle,
) -> None:
    """The session ends at the end of the run and nobody claimed the slot since: the
    outcome is recorded on a fresh session, the lease marked lost."""
    lease = granted(life.take(life.claim()))
    life.server.end(lease)

    settle_success(life.db, lease)

    assert lease.known_lost
    assert (lease.token, "succeeded") == _pick(life.run(), "token", "state")


def test_a_frozen_holder_loses_its_lock_within_the_lease(life: Lifecycle) -> None:
    """A holder that stops answering loses the lock when its lease runs out: another
    claim gets it, and the holder, asked, knows it lost it."""
    frozen = granted(life.take(life.claim(task_id="frozen"), lease=LEASE))
    life.server.freeze(frozen)

    taker = granted(life.take(life.claim(LATER, task_id="taker"), lease=LEASE))

    with pytest.raises(LockLost):
        frozen.check()
    settle_success(life.db, taker)
    settle_success(life.db, frozen)  # nobody took its slot over: its outcome is kept
    assert "succeeded" == life.run()["state"]


def test_transaction_scope_failure_rolls_back_and_records_the_attempt(life: Lifecycle) -> None:
    """Transaction scope: the failed body's claim rolls back with it, and the attempt is
    written again as failed, so the slot may run again."""
    lease = granted(life.take(life.claim(), "transaction"))

    settle_failure(life.db, lease, RuntimeError("boom"))

    assert ("failed", lease.token) == _pick(life.run(), "state", "token")
    again = granted(life.take(life.claim(), "transaction"))
    settle_success(life.db, again)
    assert ("succeeded", again.token) == _pick(life.run(), "state", "token")


class Sent:
    """What ``waiting.send_next`` publishes, written down (the Celery app's ``send_task``)."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, str, Any]] = []

    def send_task(self, name: str, *, task_id: str, headers: dict[str, Any], **_: Any) -> None:
        self.messages.append((task_id, headers[SLOT_HEADER], headers[WAITED_HEADER]))


MESSAGE = Message("tasks.report", [1], {"to": "ops"}, "json", exchange=None, routing_key=None)
NEWEST = "2026-12-07T10:02:00Z"


def test_buffer_one_keeps_one_slot_waiting_and_sends_it_when_the_lock_is_freed(
    life: Lifecycle,
) -> None:
    """buffer_one: a message that finds the lock held is not skipped but waits (its row
    `waiting`); a newer slot takes its place (the older one skipped as superseded, naming
    the newer message); the holder's release sends the waiting message, which then runs."""
    holder = granted(life.take(life.claim(SLOT, task_id="holder")))
    first = life.claim(LATER, task_id="first", buffer=True)
    assert "locked" == skipped(life.take(first)).reason
    assert [] == life.skips(LATER)  # waits: nothing logged as skipped

    decided = waiting.decide(life.db, first, MESSAGE)
    assert ("waiting", None) == (decided.outcome, decided.other_slot)
    assert "waiting" == life.run(LATER)["state"]

    newer = life.claim(NEWEST, task_id="newer", buffer=True)
    skipped(life.take(newer))
    replaced = waiting.decide(life.db, newer, MESSAGE)
    assert (LATER, "first") == replaced.replaced
    assert ("skipped", "superseded") == _pick(life.run(LATER), "state", "reason")
    assert "newer" == waiting.replaced_meanwhile(life.db, first)

    settle_success(life.db, holder)
    sent = Sent()
    waiting.send_next(life.db, sent, life.lock)
    assert [("newer", NEWEST, True)] == sent.messages

    turn = granted(life.take(newer))
    assert waiting.forget(life.db, turn.claim)
    settle_success(life.db, turn)
    assert "succeeded" == life.run(NEWEST)["state"]


def test_buffer_one_supersedes_at_once_a_slot_older_than_the_waiting_one(life: Lifecycle) -> None:
    """A slot older than the one already waiting does not wait: superseded, final."""
    holder = granted(life.take(life.claim(SLOT, task_id="holder")))
    waiting.decide(life.db, life.claim(NEWEST, task_id="newest", buffer=True), MESSAGE)

    older = waiting.decide(life.db, life.claim(LATER, task_id="older", buffer=True), MESSAGE)

    assert ("superseded", NEWEST, "newest") == (
        older.outcome,
        older.other_slot,
        older.other_task_id,
    )
    assert ["superseded"] == [row["reason"] for row in life.skips(LATER)]
    settle_success(life.db, holder)


def _keys_of(lock_name: str) -> list[int | tuple[int, int]]:
    """The advisory locks a run of ``lock_name`` may take in these tests."""
    slots = [slot_lock(lock_name, slot) for slot in (SLOT, LATER)]
    return [*lock_keys(lock_name, 2), *slots]


def _pick(row: dict[str, Any], *names: str) -> tuple[Any, ...]:
    return tuple(row[name] for name in names)
