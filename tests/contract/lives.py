"""A server for the run lifecycle's contract tests: the in-memory server or PostgreSQL,
with the library's own ``Database`` on it, and what a test does to either alike (end a
holder's session, freeze a holder, count the advisory locks held).

``life``: a process whose locks each live on a session of their own; ``shared_life``: a
worker process whose tasks run as threads, whose session-scope locks share a session.
Only the server differs; every assertion must hold on both."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol

import psycopg
import pytest

from celery_pglock import ops
from celery_pglock._config import Settings
from celery_pglock._heartbeat import unwatch
from celery_pglock._keys import lock_keys, slot_lock, split_key
from celery_pglock._locks import acquire
from celery_pglock._protocol import Claim, Lease, Skip
from celery_pglock._values import Scope
from celery_pglock.schema import Tables
from celery_pglock.store import _database as db_module
from celery_pglock.store._database import Database
from celery_pglock.store._memory import InMemoryStatements
from celery_pglock.store._memory_sessions import InMemoryServer, InMemorySession, in_memory_database
from celery_pglock.store.statements import OnConnection, Statements
from tests.fixtures.procs import wait_until

SLOT = "2026-12-07T10:00:00Z"
LATER = "2026-12-07T10:01:00Z"
LEASE = 1.0  # seconds: short, so that PostgreSQL ends a frozen holder soon
THREADS = 8  # the worker's concurrency, where sessions are shared


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
    # Statements on a session of the operator's own (``celery pglock release`` ends others).
    operator: Callable[[], AbstractContextManager[Statements]]
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

    @contextmanager
    def operator(self) -> Iterator[Statements]:
        session = self.server.connect()
        try:
            yield session
        finally:
            session.close()

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
            for key in keys_of(lock_name)
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
        for key in keys_of(lock_name):
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


SERVERS = ["twin", pytest.param("postgres", marks=pytest.mark.integration)]


@pytest.fixture(params=SERVERS)
def life(request: pytest.FixtureRequest) -> Iterator[Lifecycle]:
    yield from _lifecycle(request)


@pytest.fixture(params=SERVERS)
def shared_life(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Lifecycle]:
    monkeypatch.setattr(db_module, "_worker_pool_size", THREADS + 1)  # a -P threads worker
    for found in _lifecycle(request, pool_size=THREADS + 1):
        assert found.db.shares_sessions
        yield found


def _lifecycle(request: pytest.FixtureRequest, pool_size: int = 4) -> Iterator[Lifecycle]:
    if request.param == "twin":
        clock = Clock()
        server = InMemoryServer(InMemoryStatements(Tables("contract"), clock=clock))
        twin = TwinServer(server, clock)
        yield Lifecycle(in_memory_database(server), server.tables, twin, twin.operator)
        return
    dsn: str = request.getfixturevalue("pg_dsn")
    schema = request.getfixturevalue("pglock_schema")
    settings = Settings(dsn=dsn, schema=schema, pool_size=pool_size)
    ops.migrate(settings)
    db = Database(settings)
    db.open()
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            statements = OnConnection(conn, settings.tables, settings)
            yield Lifecycle(db, statements, PostgresServer(conn), lambda: nullcontext(statements))
    finally:
        db.close()


def granted(outcome: Lease | Skip) -> Lease:
    assert isinstance(outcome, Lease), f"expected the lock, got {outcome!r}"
    return outcome


def skipped(outcome: Lease | Skip) -> Skip:
    assert isinstance(outcome, Skip), f"expected a skip, got {outcome!r}"
    return outcome


def keys_of(lock_name: str) -> list[int | tuple[int, int]]:
    """The advisory locks a run of ``lock_name`` may take in these tests."""
    slots = [slot_lock(lock_name, slot) for slot in (SLOT, LATER)]
    return [*lock_keys(lock_name, 2), *slots]


def pick(row: dict[str, Any], *names: str) -> tuple[Any, ...]:
    return tuple(row[name] for name in names)
