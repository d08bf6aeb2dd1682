"""The chaos campaign's tasks and beat schedule, on the shared acceptance app.

Run as ``celery -A tests.chaos.chaosapp worker|beat``: the app is ``testapp.app``, configured
from the same environment (``TEST_SCHEMA``, ``TEST_NAMESPACE``, ``TEST_ACKS_LATE``,
``TEST_LEASE``, ``TEST_BEAT_LEADER``…), with these additions:

- beat entries ``short`` (``pglock_coalesce="all"``: a late slot still runs) and ``writer``
  (beat's default, ``latest``: a late slot is superseded once a newer one succeeded) every
  second, ``long`` every 2 s (its body outlasts its 3-s lease, kept by the heartbeat),
  ``tx`` every 2 s (transaction scope, sent to ``CHAOS_TX_QUEUE`` when set: the worker
  behind PgBouncer's transaction pooling), and ``buffered`` every second (a 2.5-s body
  under ``pglock_overlap = "buffer_one"``: the newest slot waits, kept in PostgreSQL);
- the Redis broker's ``visibility_timeout`` is 10 s (swept every 2 s), and beat re-sends an
  unconfirmed claim after 8 s, so both recoveries happen within a campaign;
- every message published (by beat, or a worker's retry) is appended to the Redis list
  ``CHAOS_RECORD_KEY`` at ``CHAOS_RECORD_URL``: task id, task, slot, publishing pid.

Every body records its execution with plain psycopg (one connection of its own per
execution) in ``<schema>.executions`` and writes through ``fence()`` twice, on the resource
named like its lock: once as it starts and once as it ends, each in one transaction with
its record. Before each write it asks
``self.pglock.check()`` and notes whether it learned that the lock was lost, when it asked,
and whether the write was accepted, refused (``StaleToken``) or failed. A lost lock does
not stop the body from writing: the point is to see the fence refuse the stale write. A
refused end write fails the task with ``StaleToken``.

Times are the client's ``time.time()`` (one machine, one clock). Bookkeeping transactions
are retried for up to ``RECORD_DEADLINE`` seconds while PostgreSQL restarts (a fence
with the same token is idempotent, the execution row is keyed by token). The transaction-
scope task ``tx`` makes its end write on the lock's own connection, so it commits with
the ledger row or not at all; its record of it is made beforehand, so the table of
accepted writes, not the record, says whether it committed.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
import redis
from celery import signals
from psycopg import sql

from celery_pglock import LockLost, PgLockTask, StaleToken, fence
from celery_pglock._messages import ENTRY_HEADER, SLOT_HEADER
from celery_pglock._waiting import WAITED_HEADER
from tests.apps import testapp
from tests.apps.testapp import app

__all__ = ["app"]

T = TypeVar("T")

ENV = os.environ
TX_QUEUE = ENV.get("CHAOS_TX_QUEUE") or ""
RECORD_URL = ENV.get("CHAOS_RECORD_URL") or ""
RECORD_KEY = ENV.get("CHAOS_RECORD_KEY") or "chaos:published"
LONG_LEASE = 3.0  # seconds: shorter than the long body; the heartbeat keeps it
VISIBILITY_TIMEOUT = 10  # seconds: Redis redelivers an unacknowledged message after this
RESTORE_EVERY = 2  # seconds between two sweeps for such messages
RESEND_AFTER = 8.0  # seconds: beat re-sends a claim whose sender never confirmed it
RECORD_DEADLINE = 30.0  # seconds the bookkeeping keeps retrying through an outage
RECORD_RETRY = 0.2
CONNECT_TIMEOUT = 3

#: seconds each body sleeps between its two fenced writes
BODIES = {
    "chaos.short": 0.1,
    "chaos.writer": 0.2,
    "chaos.long": 3.5,
    "chaos.tx": 0.3,
    "chaos.buffered": 2.5,
}
#: entry name -> (task, interval in seconds)
ENTRIES = {
    "short": ("chaos.short", 1.0),
    "writer": ("chaos.writer", 1.0),
    "long": ("chaos.long", 2.0),
    "tx": ("chaos.tx", 2.0),
    "buffered": ("chaos.buffered", 1.0),
}
#: entries whose slots are superseded by design: not counted by invariant (f)
BUFFERED_ENTRIES = frozenset({"buffered"})

app.conf.update(
    # kombu 5.7 sweeps for messages past their visibility timeout every
    # unacked_restore_interval x unacked_restore_throttle seconds (10 x 10 by default): a
    # killed worker's messages would come back after 100 s, not 10.
    broker_transport_options={
        "visibility_timeout": VISIBILITY_TIMEOUT,
        "unacked_restore_interval": RESTORE_EVERY,
        "unacked_restore_throttle": 1,
    },
    pglock_beat_resend_after=RESEND_AFTER,
    beat_schedule={
        name: {
            "task": task,
            "schedule": every,
            **({"options": {"queue": TX_QUEUE}} if name == "tx" else {}),
        }
        for name, (task, every) in ENTRIES.items()
        if name != "tx" or TX_QUEUE
    },
)

EXECUTION_COLUMNS = """
ALTER TABLE {executions}
    ADD COLUMN IF NOT EXISTS acquired_at    double precision,
    ADD COLUMN IF NOT EXISTS start_check_at double precision,
    ADD COLUMN IF NOT EXISTS start_lost     boolean,
    ADD COLUMN IF NOT EXISTS start_result   text,
    ADD COLUMN IF NOT EXISTS start_write_at double precision,
    ADD COLUMN IF NOT EXISTS end_check_at   double precision,
    ADD COLUMN IF NOT EXISTS end_lost       boolean,
    ADD COLUMN IF NOT EXISTS end_result     text,
    ADD COLUMN IF NOT EXISTS end_write_at   double precision,
    ADD COLUMN IF NOT EXISTS ended_at       double precision
"""
UNIQUE_TOKENS = "CREATE UNIQUE INDEX IF NOT EXISTS {index} ON {executions} (token)"
FENCED_WRITES = """
CREATE TABLE IF NOT EXISTS {writes} (
    id       bigserial PRIMARY KEY,
    resource text NOT NULL,
    token    bigint NOT NULL,
    kind     text NOT NULL,
    task_id  text,
    at       double precision NOT NULL
)"""


def create_tables(conn: psycopg.Connection[Any]) -> None:
    """The campaign's columns on ``executions`` and its table of accepted fenced writes."""
    testapp.create_tables(conn)
    names = {
        "executions": testapp.table("executions"),
        "writes": testapp.table("fenced_writes"),
        "index": sql.Identifier("executions_token_uniq"),
    }
    for text in (EXECUTION_COLUMNS, UNIQUE_TOKENS, FENCED_WRITES):
        conn.execute(sql.SQL(text).format(**names))


def learned_lost(task: Any) -> tuple[float, bool]:
    """(when we asked, whether the server said the lock is gone), via ``check()``."""
    asked = time.time()
    try:
        task.pglock.check()
    except LockLost:
        return asked, True
    return asked, False


def write_through_fence(conn: psycopg.Connection[Any], task: Any, kind: str) -> tuple[str, float]:
    """One fenced write on ``conn``, in its transaction: ("accepted" | "refused", when).

    "when" is taken as ``fence()`` returns: from then on a newer token waits for our
    commit (the fence row is locked), or has already refused us.
    """
    lease = task.pglock
    try:
        fence(conn, lease.lock, lease.token)
    except StaleToken:
        return "refused", time.time()
    at = time.time()
    insert = sql.SQL(
        "INSERT INTO {} (resource, token, kind, task_id, at) VALUES (%s, %s, %s, %s, %s)"
    ).format(testapp.table("fenced_writes"))
    conn.execute(insert, (lease.lock, lease.token, kind, task.request.id, at))
    return "accepted", at


START_SQL = (
    "INSERT INTO {} (task, task_id, lock_name, slot, token, pid, acquired_at, start_check_at, "
    "start_lost, start_result, start_write_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, "
    "%s) ON CONFLICT (token) DO NOTHING"
)
END_SQL = (
    "UPDATE {} SET end_check_at = %s, end_lost = %s, end_result = %s, end_write_at = %s, "
    "ended_at = %s, finished = to_timestamp(%s) WHERE token = %s"
)


class Books:
    """One plain connection (not the library's) for an execution's records and writes.

    ``run(action)`` runs ``action(conn)`` in a transaction; while PostgreSQL is unreachable
    it reconnects and runs it again, for up to ``RECORD_DEADLINE`` seconds.
    """

    def __init__(self) -> None:
        self.conn: psycopg.Connection[Any] | None = None

    def run(self, action: Callable[[psycopg.Connection[Any]], T]) -> T:
        deadline = time.monotonic() + RECORD_DEADLINE
        while True:
            try:
                if self.conn is None or self.conn.closed:
                    self.conn = psycopg.connect(
                        testapp.DSN, connect_timeout=CONNECT_TIMEOUT, autocommit=True
                    )
                with self.conn.transaction():
                    return action(self.conn)
            except psycopg.OperationalError:
                self.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(RECORD_RETRY)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def record_start(books: Books, task: Any, acquired_at: float, *, fenced: bool) -> None:
    """Check, write through the fence and insert the execution row, in one transaction."""
    lease = task.pglock
    insert = sql.SQL(START_SQL).format(testapp.table("executions"))

    def attempt(conn: psycopg.Connection[Any]) -> None:
        checked_at, lost = learned_lost(task)
        result, at = write_through_fence(conn, task, "start") if fenced else ("none", None)
        identity = (task.name, task.request.id, lease.lock, lease.slot, lease.token)
        conn.execute(insert, (*identity, os.getpid(), acquired_at, checked_at, lost, result, at))

    books.run(attempt)


def record_end(books: Books, task: Any, checked_at: float, lost: bool, written: Any) -> None:
    """Note the end write (``(result, when)``) and the end of the body on the execution row."""
    update = sql.SQL(END_SQL).format(testapp.table("executions"))
    result, at = written
    ended = time.time()

    def attempt(conn: psycopg.Connection[Any]) -> None:
        conn.execute(update, (checked_at, lost, result, at, ended, ended, task.pglock.token))

    books.run(attempt)


def run_body(task: Any) -> int:
    """Session scope: start write, body, end write (with its record); the token is the result."""
    books = Books()
    update = sql.SQL(END_SQL).format(testapp.table("executions"))

    def end(conn: psycopg.Connection[Any]) -> str:
        checked_at, lost = learned_lost(task)
        result, at = write_through_fence(conn, task, "end")
        ended = time.time()
        conn.execute(update, (checked_at, lost, result, at, ended, ended, task.pglock.token))
        return result

    try:
        record_start(books, task, time.time(), fenced=True)
        time.sleep(BODIES[task.name])
        result = books.run(end)
    finally:
        books.close()
    if result == "refused":
        raise StaleToken(task.pglock.lock, int(task.pglock.token), None)
    return int(task.pglock.token)


@app.task(bind=True, base=PgLockTask, name="chaos.short", pglock_coalesce="all")
def short(self: Any) -> int:
    """A short body (0.1 s) every second; a late slot still runs (``coalesce="all"``)."""
    return run_body(self)


@app.task(bind=True, base=PgLockTask, name="chaos.writer")
def writer(self: Any) -> int:
    """A writer every second: its writes commit through ``fence()``. Beat's default policy:
    a late slot is ``superseded`` once a newer one succeeded."""
    return run_body(self)


@app.task(bind=True, base=PgLockTask, name="chaos.long", pglock_lease=LONG_LEASE)
def long_task(self: Any) -> int:
    """A body of 3.5 s under a 3-s lease, every 2 s (every other slot finds it locked)."""
    return run_body(self)


@app.task(bind=True, base=PgLockTask, name="chaos.tx", pglock_scope="transaction")
def tx(self: Any) -> int:
    """Transaction scope: the end write commits with the lock's transaction and ledger row."""
    books = Books()
    try:
        record_start(books, self, time.time(), fenced=False)
        time.sleep(BODIES[self.name])
        checked_at, lost = learned_lost(self)
        try:
            written = write_through_fence(self.pglock.connection, self, "end")
        except psycopg.Error:
            written = ("error", time.time())
        record_end(books, self, checked_at, lost, written)
    finally:
        books.close()
    if written[0] == "refused":
        raise StaleToken(self.pglock.lock, int(self.pglock.token), None)
    if written[0] == "error":
        raise RuntimeError("the end write failed in the lock's transaction")
    return int(self.pglock.token)


@app.task(bind=True, base=PgLockTask, name="chaos.buffered", pglock_overlap="buffer_one")
def buffered(self: Any) -> int:
    """A 2.5-s body every second under ``buffer_one``: while it runs, the newest slot waits
    (kept in PostgreSQL) and runs next; the others are ``superseded``."""
    return run_body(self)


_recorder: redis.Redis | None = None


@signals.after_task_publish.connect(weak=False)
def remember_published(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """Append every published message (id, task, slot, entry, pid) to the Redis record."""
    global _recorder  # noqa: PLW0603 - one client per process, created on first use
    if not RECORD_URL or not headers:
        return
    if _recorder is None:
        _recorder = redis.Redis.from_url(RECORD_URL)
    record = {
        "task_id": headers.get("id"),
        "task": headers.get("task"),
        "slot": headers.get(SLOT_HEADER),
        "entry": headers.get(ENTRY_HEADER),
        "retries": headers.get("retries") or 0,
        "waited": bool(headers.get(WAITED_HEADER)),  # a waiting slot's message, sent again
        "pid": os.getpid(),
        "at": time.time(),
    }
    _recorder.rpush(RECORD_KEY, json.dumps(record))
