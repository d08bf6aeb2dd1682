"""The Celery app that acceptance tests run in real ``celery worker``/``celery beat`` processes.

Configured from the environment (see ``app_env`` in tests/apps/harness.py):

- ``TEST_BROKER_URL``, ``TEST_RESULT_BACKEND`` (optional), ``TEST_QUEUE`` (a queue per test,
  so tests sharing a broker never see each other's messages);
- ``PGLOCK_DSN`` and ``TEST_SCHEMA`` (the test's own schema: our tables and ``executions``);
- ``TEST_ACKS_LATE`` ("1"), ``TEST_LEASE`` (seconds), ``TEST_BEAT_EVERY`` (seconds: one
  interval entry ``tick``), ``TEST_BEAT_LEADER`` ("0" = active-active), ``TEST_BEAT_LEASE``,
  ``TEST_BEAT_SENDERS`` (``pglock_beat_senders``);
- ``TEST_NAMESPACE`` (optional ``pglock_namespace``: lock names are database-wide);
- ``TEST_BEAT_ENTRIES`` (instead: that many entries ``e00000``… of ``testapp.scale_tick``,
  every ``TEST_BEAT_ENTRIES_EVERY`` seconds, default 10: all due at once);
- ``TEST_BEAT_TASK`` (the ``tick`` entry's task, default ``testapp.tick``),
  ``TEST_SLOW_TICK`` (seconds ``testapp.slow_tick`` takes, default 0.3);
- ``TEST_PGLOCK_ENABLED`` ("0" = ``pglock_enabled = False``, the test mode);
- ``TEST_AUTO_MIGRATE`` ("0" = ``pglock_auto_migrate = False``). With a ``db+…`` result
  backend, its tables live in ``TEST_SCHEMA`` too;
- ``TEST_BEAT_CATCH_UP``, ``TEST_BEAT_CATCH_UP_LIMIT`` (``pglock_beat_catch_up`` and its
  limit);
- ``TEST_OVERLAP`` (the app-wide ``pglock_overlap``);
- ``TEST_OVERDUE_AFTER`` (``pglock_overdue_after``); with ``TEST_RECORD_OVERDUE`` ("1") a
  beat records each ``task_overdue`` signal in ``<schema>.overdue``;
- ``TEST_BEAT_MORE``: more interval entries of ``testapp.tick``, as a JSON object of
  name to seconds (``{"nightly": 86400}``);
- ``TEST_PGLOCK_CONF``: any more settings, as a JSON object
  (``{"pglock_connection_max_retries": 2}``).

Every task body records its execution in ``<schema>.executions`` (what ran, with which
slot and fencing token, in which process), which is what the tests assert on. The
``gated*`` tasks block until the test opens a gate (``harness.gate``), so a test decides
when a run ends instead of sleeping.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

import psycopg
from celery import Celery
from psycopg import sql

from celery_pglock import LockLost, PgLockTask, fence, signals

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
    pglock_beat_senders=int(ENV.get("TEST_BEAT_SENDERS", "1")),
    beat_scheduler=ENV.get("TEST_BEAT_SCHEDULER", "celery_pglock.beat:PgLockScheduler"),
)
if ENV.get("TEST_NAMESPACE"):
    # Lock names (and the beat leader lock) are database-wide: tests running side by side
    # on one server keep apart by namespace.
    app.conf.pglock_namespace = ENV["TEST_NAMESPACE"]
if ENV.get("TEST_AUTO_MIGRATE") == "0":
    app.conf.pglock_auto_migrate = False
if ENV.get("TEST_PGLOCK_ENABLED") == "0":
    app.conf.pglock_enabled = False
if ENV.get("TEST_BEAT_CATCH_UP"):
    app.conf.pglock_beat_catch_up = ENV["TEST_BEAT_CATCH_UP"]
if ENV.get("TEST_BEAT_CATCH_UP_LIMIT"):
    app.conf.pglock_beat_catch_up_limit = int(ENV["TEST_BEAT_CATCH_UP_LIMIT"])
if ENV.get("TEST_OVERLAP"):  # app-wide pglock_overlap (a bad one stops the worker)
    app.conf.pglock_overlap = ENV["TEST_OVERLAP"]
if ENV.get("TEST_OVERDUE_AFTER"):
    app.conf.pglock_overdue_after = float(ENV["TEST_OVERDUE_AFTER"])
if ENV.get("TEST_PGLOCK_CONF"):
    app.conf.update(json.loads(ENV["TEST_PGLOCK_CONF"]))
if (ENV.get("TEST_RESULT_BACKEND") or "").startswith("db+"):
    # The database result backend keeps its tables in the test's schema, dropped with it.
    app.conf.database_table_schemas = {"task": SCHEMA, "group": SCHEMA}
if ENV.get("TEST_BEAT_EVERY"):
    app.conf.beat_schedule = {
        "tick": {
            "task": ENV.get("TEST_BEAT_TASK", "testapp.tick"),
            "schedule": float(ENV["TEST_BEAT_EVERY"]),
        },
    }
    for name, every in json.loads(ENV.get("TEST_BEAT_MORE", "{}")).items():
        app.conf.beat_schedule[name] = {"task": "testapp.tick", "schedule": float(every)}
if ENV.get("TEST_BEAT_ENTRIES"):  # a generated schedule: that many entries, due together
    app.conf.beat_schedule = {
        f"e{n:05d}": {
            "task": "testapp.scale_tick",
            "schedule": float(ENV.get("TEST_BEAT_ENTRIES_EVERY", "10")),
            "args": [n],
        }
        for n in range(int(ENV["TEST_BEAT_ENTRIES"]))
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
OBSERVATIONS_SQL = """
CREATE TABLE IF NOT EXISTS {observations} (
    task_id text,
    token   bigint,
    lost    boolean NOT NULL,
    cause   text
)"""


def table(name: str) -> sql.Identifier:
    return sql.Identifier(SCHEMA, name)


def create_tables(conn: psycopg.Connection[Any]) -> None:
    conn.execute(sql.SQL(EXECUTIONS_SQL).format(executions=table("executions")))
    conn.execute(sql.SQL(WRITES_SQL).format(writes=table("writes")))
    conn.execute(sql.SQL(OBSERVATIONS_SQL).format(observations=table("observations")))


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


def scale_key(n: int) -> str:
    """Each generated entry's own lock (its argument): the entries never share slots."""
    return f"{ENV.get('TEST_NAMESPACE', 'testapp')}:scale:{n}"


@app.task(
    bind=True,
    base=PgLockTask,
    name="testapp.scale_tick",
    pglock_scope="transaction",
    pglock_key=scale_key,
)
def scale_tick(self: Any, n: int) -> None:
    """The task of a generated schedule's entries (``n``: the entry's number, its lock):
    recorded in the lock's own transaction (no connection of its own), so that thousands
    of them run quickly."""
    record(self, conn=self.pglock.connection)


@app.task(bind=True, base=PgLockTask, name="testapp.always_fails")
def always_fails(self: Any) -> None:
    """A beat entry's task that fails every time (its entry goes overdue)."""
    finish(record(self))
    raise RuntimeError("asked to fail, every time")


OVERDUE_SQL = """
CREATE TABLE IF NOT EXISTS {overdue} (
    entry text, slot text, overdue_seconds float8, at timestamptz DEFAULT clock_timestamp()
)"""


if ENV.get("TEST_RECORD_OVERDUE") == "1":

    @signals.task_overdue.connect(weak=False)
    def record_overdue(entry: str, slot: str, overdue_seconds: float, **_: Any) -> None:
        """Note each ``task_overdue`` signal, and when it fired."""
        query = sql.SQL("INSERT INTO {} (entry, slot, overdue_seconds) VALUES (%s, %s, %s)")
        with psycopg.connect(DSN, autocommit=True) as conn:
            conn.execute(query.format(table("overdue")), (entry, slot, overdue_seconds))


@app.task(bind=True, base=PgLockTask, name="testapp.slow_tick")
def slow_tick(self: Any) -> None:
    """A beat entry's task that takes a while, so overlapping executions would show."""
    row = record(self)
    time.sleep(float(ENV.get("TEST_SLOW_TICK", "0.3")))
    finish(row)


# -- keyed: the caller names the lock, so one worker serves many independent locks -------


def by_key(key: str, **_: Any) -> str:
    """``pglock_key`` of the ``keyed*`` tasks: their first argument."""
    return key


def run_keyed(task: Any, marker: str | None) -> Any:
    finish(record(task, marker))
    return task.pglock.token if task.pglock else None


@app.task(bind=True, base=PgLockTask, name="testapp.keyed", pglock_key=by_key)
def keyed(self: Any, key: str, marker: str | None = None) -> Any:
    """Locked on ``key``; coalescing as configured app-wide (default: beat messages)."""
    return run_keyed(self, marker)


@app.task(
    bind=True, base=PgLockTask, name="testapp.keyed_all", pglock_key=by_key, pglock_coalesce="all"
)
def keyed_all(self: Any, key: str, marker: str | None = None) -> Any:
    """Locked on ``key``; every slot runs (``pglock_coalesce="all"``)."""
    return run_keyed(self, marker)


@app.task(
    bind=True,
    base=PgLockTask,
    name="testapp.keyed_latest",
    pglock_key=by_key,
    pglock_coalesce="latest",
)
def keyed_latest(self: Any, key: str, marker: str | None = None) -> Any:
    """Locked on ``key``; coalescing for every slotted message, beat's or not."""
    return run_keyed(self, marker)


@app.task(
    bind=True,
    base=PgLockTask,
    name="testapp.keyed_fresh",
    pglock_key=by_key,
    pglock_max_lateness=60,
)
def keyed_fresh(self: Any, key: str, marker: str | None = None) -> Any:
    """Locked on ``key``; a time slot older than 60 s when it starts is skipped."""
    return run_keyed(self, marker)


@app.task(
    bind=True,
    base=PgLockTask,
    name="testapp.keyed_checked",
    pglock_key=by_key,
    pglock_check_on_enqueue=True,
)
def keyed_checked(self: Any, key: str, marker: str | None = None) -> Any:
    """Locked on ``key``; a slot that succeeded or runs is not even published."""
    return run_keyed(self, marker)


@app.task(base=PgLockTask, name="testapp.echo")
def echo(value: Any = None) -> Any:
    """A locked task that touches no database itself: returns its argument."""
    return value


@app.task(name="testapp.plain")
def plain(seconds: float = 0.0) -> None:
    """A stock task, for comparison."""
    time.sleep(seconds)


# -- gates: a task blocks until the test opens its gate, so no test sleeps and hopes ------

GATE_CLASS = 0x67617465  # first key of the two-key advisory lock a gate is; never a pglock key
GATE_TIMEOUT = "60s"  # a gate the test forgot fails the task instead of hanging the worker


def wait_for_gate(gate: int | None) -> None:
    """Block until the test opens gate ``gate`` (see ``harness.gate``); None: do not wait."""
    if gate is None:
        return
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("SET lock_timeout = {}").format(sql.Literal(GATE_TIMEOUT)))
        conn.execute("SELECT pg_advisory_lock(%s, %s)", (GATE_CLASS, gate))


def observe_lease(task: Any) -> None:
    """Ask the server whether this run still holds its lock; note the answer."""
    lease = task.pglock
    with contextlib.suppress(LockLost):  # check() also sets lease.lost, noted below
        lease.check()
    query = sql.SQL("INSERT INTO {} (task_id, token, lost, cause) VALUES (%s, %s, %s, %s)").format(
        table("observations")
    )
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(query, (task.request.id, lease.token, lease.lost, lease.lost_cause))


@app.task(bind=True, base=PgLockTask, name="testapp.gated")
def gated(self: Any, gate: int | None = None, marker: str | None = None) -> Any:
    """Record, wait until the test opens ``gate``, finish; return the fencing token."""
    row = record(self, marker)
    wait_for_gate(gate)
    finish(row)
    return self.pglock.token if self.pglock else None


@app.task(
    bind=True,
    base=PgLockTask,
    name="testapp.gated_scheduled_only",
    pglock_scheduled_only=True,
)
def gated_scheduled_only(self: Any, gate: int | None = None, marker: str | None = None) -> Any:
    """Like ``gated``, but locked only when the message carries a slot."""
    row = record(self, marker)
    wait_for_gate(gate)
    finish(row)
    return self.pglock.token if self.pglock else None


@app.task(bind=True, base=PgLockTask, name="testapp.gated_buffered", pglock_overlap="buffer_one")
def gated_buffered(self: Any, gate: int | None = None, marker: str | None = None) -> Any:
    """Like ``gated``, under ``pglock_overlap = "buffer_one"``: one slot waits its turn."""
    return _gated_run(self, gate, marker)


@app.task(bind=True, base=PgLockTask, name="testapp.gated_limited", pglock_concurrency=3)
def gated_limited(self: Any, gate: int | None = None, marker: str | None = None) -> Any:
    """Like ``gated``, up to 3 runs at once (``pglock_concurrency = 3``)."""
    return _gated_run(self, gate, marker)


@app.task(
    bind=True,
    base=PgLockTask,
    name="testapp.gated_limited_buffered",
    pglock_concurrency=3,
    pglock_overlap="buffer_one",
)
def gated_limited_buffered(self: Any, gate: int | None = None, marker: str | None = None) -> Any:
    """Up to 3 runs at once, and one slot waits for a free one."""
    return _gated_run(self, gate, marker)


@app.task(
    bind=True,
    base=PgLockTask,
    name="testapp.gated_limited_tx",
    pglock_concurrency=3,
    pglock_scope="transaction",
)
def gated_limited_tx(self: Any, gate: int | None = None, marker: str | None = None) -> Any:
    """Transaction scope, up to 3 runs at once: recorded in each lock's own transaction."""
    record(self, marker, conn=self.pglock.connection)
    wait_for_gate(gate)
    return self.pglock.token


def _gated_run(task: Any, gate: int | None, marker: str | None) -> Any:
    row = record(task, marker)
    wait_for_gate(gate)
    finish(row)
    return task.pglock.token if task.pglock else None


@app.task(bind=True, base=PgLockTask, name="testapp.buffered_tick", pglock_overlap="buffer_one")
def buffered_tick(self: Any) -> None:
    """A beat entry's slow task under ``buffer_one``: slots that come while it runs wait."""
    row = record(self)
    time.sleep(float(ENV.get("TEST_SLOW_TICK", "0.3")))
    finish(row)


@app.task(bind=True, base=PgLockTask, name="testapp.gated_tx", pglock_scope="transaction")
def gated_tx(self: Any, gate: int | None = None, marker: str | None = None) -> Any:
    """Transaction scope: record in the lock's own transaction, wait for ``gate``."""
    record(self, marker, conn=self.pglock.connection)
    wait_for_gate(gate)
    return self.pglock.token


@app.task(bind=True, base=PgLockTask, name="testapp.fenced_gated")
def fenced_gated(self: Any, gate: int | None = None, marker: str | None = None) -> Any:
    """Wait for ``gate`` (a test may freeze us meanwhile), note whether the lock is still
    held (``observations``), then write through fence(); StaleToken if superseded."""
    row = record(self, marker)
    wait_for_gate(gate)
    observe_lease(self)
    with psycopg.connect(DSN) as conn, conn.transaction():
        fence(conn, "fenced-resource", self.pglock.token)
        insert = sql.SQL("INSERT INTO {} (token, marker) VALUES (%s, %s)").format(table("writes"))
        conn.execute(insert, (self.pglock.token, marker))
    finish(row)
    return {"token": self.pglock.token, "lost": self.pglock.lost}


@app.task(bind=True, base=PgLockTask, name="testapp.keyed_observed", pglock_key=by_key)
def keyed_observed(self: Any, key: str, gate: int | None = None) -> Any:
    """Locked on ``key``: record, wait for ``gate`` (a test may freeze us meanwhile), then
    note whether the lock is still held (``observations``)."""
    row = record(self, key)
    wait_for_gate(gate)
    observe_lease(self)
    finish(row)
    return self.pglock.token
