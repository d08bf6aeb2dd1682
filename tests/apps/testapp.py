"""The Celery app that acceptance tests run in real ``celery worker``/``celery beat`` processes.

Configured from the environment (see ``app_env`` in tests/apps/harness.py):

- ``TEST_BROKER_URL``, ``TEST_RESULT_BACKEND`` (optional), ``TEST_QUEUE`` (a queue per test,
  so tests sharing a broker never see each other's messages);
- ``PGLOCK_DSN`` and ``TEST_SCHEMA`` (the test's own schema: our tables and ``executions``);
- ``TEST_ACKS_LATE`` ("1"), ``TEST_LEASE`` (seconds), ``TEST_BEAT_EVERY`` (seconds: one
  interval entry ``tick``), ``TEST_BEAT_LEADER`` ("0" = active-active), ``TEST_BEAT_LEASE``.

Every task body records its execution in ``<schema>.executions`` (what ran, with which
slot and fencing token, in which process), which is what the tests assert on.
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg
from celery import Celery
from psycopg import sql

from celery_pglock import PgLockTask, fence

ENV = os.environ
SCHEMA = ENV.get("TEST_SCHEMA", "public")
DSN = ENV.get("PGLOCK_DSN", "")

app = Celery("testapp")
app.conf.update(
    broker_url=ENV.get("TEST_BROKER_URL", "redis://127.0.0.1:6379/0"),
    result_backend=ENV.get("TEST_RESULT_BACKEND") or None,
    task_default_queue=ENV.get("TEST_QUEUE", "celery"),
    task_acks_late=ENV.get("TEST_ACKS_LATE") == "1",
    task_reject_on_worker_lost=ENV.get("TEST_ACKS_LATE") == "1",
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    pglock_dsn=DSN,
    pglock_schema=SCHEMA,
    pglock_lease=float(ENV.get("TEST_LEASE", "30")),
    pglock_beat_leader=ENV.get("TEST_BEAT_LEADER", "1") == "1",
    pglock_beat_lease=float(ENV.get("TEST_BEAT_LEASE", "5")),
    beat_scheduler=ENV.get("TEST_BEAT_SCHEDULER", "celery_pglock.beat:PgLockScheduler"),
)
if ENV.get("TEST_BEAT_EVERY"):
    app.conf.beat_schedule = {
        "tick": {"task": "testapp.tick", "schedule": float(ENV["TEST_BEAT_EVERY"])},
    }

EXECUTIONS_SQL = """
CREATE TABLE IF NOT EXISTS {executions} (
    id        bigserial PRIMARY KEY,
    task      text NOT NULL,
    task_id   text,
    lock_name text,
    slot      text,
    token     bigint,
    pid       integer NOT NULL,
    marker    text,
    started   timestamptz NOT NULL DEFAULT clock_timestamp(),
    finished  timestamptz
)"""
WRITES_SQL = "CREATE TABLE IF NOT EXISTS {writes} (token bigint, marker text)"


def table(name: str) -> sql.Identifier:
    return sql.Identifier(SCHEMA, name)


def create_tables(conn: psycopg.Connection[Any]) -> None:
    conn.execute(sql.SQL(EXECUTIONS_SQL).format(executions=table("executions")))
    conn.execute(sql.SQL(WRITES_SQL).format(writes=table("writes")))


def record(task: Any, marker: str | None = None, conn: Any = None) -> int:
    """Insert one execution row; on ``conn`` (transaction scope) or a fresh connection."""
    lease = task.pglock
    query = sql.SQL(
        "INSERT INTO {} (task, task_id, lock_name, slot, token, pid, marker) "
        "VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING id"
    ).format(table("executions"))
    values = (
        task.name,
        task.request.id,
        lease.lock if lease else None,
        lease.slot if lease else None,
        lease.token if lease else None,
        os.getpid(),
        marker,
    )
    if conn is not None:
        return int(conn.execute(query, values).fetchone()[0])
    with psycopg.connect(DSN, autocommit=True) as own:
        return int(own.execute(query, values).fetchone()[0])


def finish(row_id: int) -> None:
    query = sql.SQL("UPDATE {} SET finished = clock_timestamp() WHERE id = %s")
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(query.format(table("executions")), (row_id,))


@app.task(bind=True, base=PgLockTask, name="testapp.work")
def work(self: Any, seconds: float = 0.0, fail: bool = False, marker: str | None = None) -> Any:
    """Record, sleep, optionally fail; return the fencing token."""
    row = record(self, marker)
    time.sleep(seconds)
    if fail:
        raise RuntimeError(f"asked to fail ({marker})")
    finish(row)
    return self.pglock.token if self.pglock else None


@app.task(bind=True, base=PgLockTask, name="testapp.work_tx", pglock_scope="transaction")
def work_tx(self: Any, seconds: float = 0.0, fail: bool = False, marker: str | None = None) -> Any:
    """Transaction scope: the execution row is written in the lock's own transaction."""
    record(self, marker, conn=self.pglock.connection)
    time.sleep(seconds)
    if fail:
        raise RuntimeError(f"asked to fail ({marker})")
    return self.pglock.token


@app.task(bind=True, base=PgLockTask, name="testapp.fenced")
def fenced(self: Any, seconds: float = 0.0, marker: str | None = None) -> Any:
    """Sleep (a test may freeze us meanwhile), then write through fence()."""
    record(self, marker)
    time.sleep(seconds)
    lost_before_write = self.pglock.lost
    with psycopg.connect(DSN) as conn, conn.transaction():
        fence(conn, "fenced-resource", self.pglock.token)
        insert = sql.SQL("INSERT INTO {} (token, marker) VALUES (%s, %s)").format(table("writes"))
        conn.execute(insert, (self.pglock.token, marker))
    return {"token": self.pglock.token, "lost": lost_before_write}


@app.task(bind=True, base=PgLockTask, name="testapp.scheduled_only", pglock_scheduled_only=True)
def scheduled_only(self: Any, seconds: float = 0.0, marker: str | None = None) -> Any:
    """Locked only when the message carries a slot."""
    row = record(self, marker)
    time.sleep(seconds)
    finish(row)


@app.task(bind=True, base=PgLockTask, name="testapp.tick")
def tick(self: Any) -> None:
    """The beat entry's task."""
    finish(record(self))


@app.task(name="testapp.plain")
def plain(seconds: float = 0.0) -> None:
    """A stock task, for comparison."""
    time.sleep(seconds)
