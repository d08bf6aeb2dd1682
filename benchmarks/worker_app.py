"""The Celery app the worker benchmarks run in a real ``celery worker`` (prefork).

Every contender is a no-op task taking one argument ``n`` (unique per message, so that
per-argument locks never collide). Configured from the environment: ``BENCH_BROKER_URL``,
``BENCH_RESULT_BACKEND`` (optional), ``PGLOCK_DSN``, ``BENCH_SCHEMA``, ``BENCH_PREFIX``
(Redis key prefix of celery-once and celery-singleton), ``BENCH_FIFO`` and
``BENCH_SLEEP`` (seconds the contention task sleeps).

Each worker process reports every task through the FIFO ``BENCH_FIFO``
(``benchmarks.records``): its ``task_prerun`` and ``task_postrun`` times, when a skip was
decided, when a body ran.
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg
from celery import Celery, Task
from celery_once import QueueOnce  # type: ignore[import-untyped]
from celery_singleton import Singleton  # type: ignore[import-untyped]

from benchmarks.records import BODY_RAN, SKIP_DECIDED, report, started, time_tasks
from celery_pglock import PgLockTask
from celery_pglock import signals as pglock_signals
from celery_pglock._config import Settings
from celery_pglock._keys import lock_key
from celery_pglock._locks import acquire_params, lease_ms, release_params
from celery_pglock._protocol import Claim, Lease
from celery_pglock.store import _unwaited as unwaited
from celery_pglock.store._connections import HOSTNAME, application_name
from celery_pglock.store._lock_sessions import DriverSession

ENV = os.environ
DSN = ENV.get("PGLOCK_DSN", "")
SCHEMA = ENV.get("BENCH_SCHEMA", "public")
PREFIX = ENV.get("BENCH_PREFIX", "pglockbench")
BROKER = ENV.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/15")


app = Celery("pglockbench")
app.conf.update(
    broker_url=BROKER,
    result_backend=ENV.get("BENCH_RESULT_BACKEND") or None,
    task_ignore_result=not ENV.get("BENCH_RESULT_BACKEND"),
    task_default_queue=f"{PREFIX}-default",
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    pglock_dsn=DSN,
    pglock_schema=SCHEMA,
    pglock_namespace=PREFIX,
    ONCE={
        "backend": "celery_once.backends.Redis",
        "settings": {"url": BROKER, "default_timeout": 3600},
    },
    singleton_backend_url=BROKER,
    singleton_key_prefix=f"{PREFIX}-singleton-",
)


def per_message_key(n: str, **_: Any) -> str:
    return f"{PREFIX}:{n}"


# -- contenders (same body everywhere: nothing) --------------------------------------------


@app.task(name="bench.plain")
def plain(n: str) -> None:
    """Stock Celery Task."""


@app.task(name="bench.session_mutex", base=PgLockTask, pglock_key=per_message_key)
def session_mutex(n: str) -> None:
    """Session scope, no slot: the advisory lock only (mutual exclusion)."""


@app.task(name="bench.session_slot", base=PgLockTask, pglock_key=per_message_key)
def session_slot(n: str) -> None:
    """Session scope with a slot (``pglock_slot`` header, as beat sends it): lock + ledger."""


@app.task(
    name="bench.transaction_slot",
    base=PgLockTask,
    pglock_key=per_message_key,
    pglock_scope="transaction",
)
def transaction_slot(n: str) -> None:
    """Transaction scope with a slot: lock, ledger and body in one transaction."""


@app.task(name="bench.once", base=QueueOnce)
def once(n: str) -> None:
    """celery-once: Redis lock taken at publish, cleared after the run."""


@app.task(name="bench.singleton", base=Singleton)
def singleton(n: str) -> None:
    """celery-singleton: Redis lock taken at publish, cleared after the run."""


@app.task(name="bench.contended", base=PgLockTask)
def contended(n: str) -> None:
    """One lock (the task name) for every message; the body takes ``BENCH_SLEEP`` s."""
    report(BODY_RAN, time.monotonic(), time.monotonic(), CODES["bench.contended"])
    time.sleep(float(ENV.get("BENCH_SLEEP", "0.05")))


# -- the floor: our own statements, bare, on one connection per process ----------------


class Floor:
    """The SQL a locked run must issue, without Celery, the pool or our Python around it."""

    def __init__(self, dsn: str, schema: str) -> None:
        self.dsn = dsn
        self.conn: psycopg.Connection[Any] | None = None
        self.settings = Settings(dsn=dsn, schema=schema)
        self.tables = self.settings.tables
        self.idle_ms = "0"
        self.reply_pending = False

    def connection(self, autocommit: bool) -> psycopg.Connection[Any]:
        if self.conn is None:
            name = f"celery-pglock-floor {os.getpid()}@{HOSTNAME}"  # CPU accounting finds it
            self.conn = psycopg.connect(self.dsn, autocommit=True, application_name=name)
            row = self.conn.execute("SELECT current_setting('idle_session_timeout')").fetchone()
            self.idle_ms = row[0] if row else "0"
        if self.reply_pending:  # read, as our Database does when it gives it out again
            unwaited.read_reply(self.conn, timeout=5.0)
            self.reply_pending = False
        if self.conn.autocommit != autocommit:
            self.conn.autocommit = autocommit
        return self.conn

    def claim(self, n: str, slot: str | None, task_id: str) -> Claim:
        name = per_message_key(n)
        return Claim(name, lock_key(name), slot, task_id, "bench.floor", pid=os.getpid())

    def session(self, n: str, slot: str | None, task_id: str) -> None:
        """Our ``acquire`` and ``release`` statements, session scope, sent as we send them:
        without a slot the release is not waited for (its reply is read on the next call)."""
        conn = self.connection(autocommit=True)
        claim = self.claim(n, slot, task_id)
        params = acquire_params(claim, "session", lease_ms(30.0))
        statement = "acquire" if slot is not None else "acquire_mutex"
        row = conn.execute(self.tables.query(statement), params).fetchone()
        assert row is not None
        if slot is None:
            release = [self.idle_ms, application_name()]
            unwaited.send(conn, self.tables.query("release_unwaited"), release, timeout=5.0)
            self.reply_pending = True
            return
        session = DriverSession(conn, self.settings)
        lease = Lease(claim, "session", session, token=row[2], attempts=row[3], lease_seconds=30.0)
        done = release_params(lease, "succeeded", None, self.idle_ms)
        conn.execute(self.tables.query("release"), done).fetchone()

    def transaction(self, n: str, slot: str, task_id: str) -> None:
        """Transaction scope: BEGIN, acquire, release, COMMIT (psycopg's BEGIN/COMMIT)."""
        conn = self.connection(autocommit=False)
        claim = self.claim(n, slot, task_id)
        params = acquire_params(claim, "transaction", lease_ms(30.0))
        row = conn.execute(self.tables.query("acquire"), params).fetchone()
        assert row is not None
        session = DriverSession(conn, self.settings)
        lease = Lease(
            claim, "transaction", session, token=row[2], attempts=row[3], lease_seconds=30.0
        )
        done = release_params(lease, "succeeded", None, None)
        conn.execute(self.tables.query("release"), done).fetchone()
        conn.commit()

    def minimal(self, n: str) -> None:
        """Mutual exclusion alone: try-lock, unlock."""
        conn = self.connection(autocommit=True)
        key = lock_key(per_message_key(n))
        conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()
        conn.execute("SELECT pg_advisory_unlock(%s)", (key,)).fetchone()


_floor = Floor(DSN, SCHEMA)


@app.task(name="bench.floor_mutex", bind=True)
def floor_mutex(self: Task, n: str) -> None:  # type: ignore[type-arg]
    """Floor of ``session_mutex``: its two statements, bare."""
    _floor.session(n, None, str(self.request.id))


@app.task(name="bench.floor_slot", bind=True)
def floor_slot(self: Task, n: str) -> None:  # type: ignore[type-arg]
    """Floor of ``session_slot``: its two statements, bare."""
    _floor.session(n, n, str(self.request.id))


@app.task(name="bench.floor_transaction", bind=True)
def floor_transaction(self: Task, n: str) -> None:  # type: ignore[type-arg]
    """Floor of ``transaction_slot``: its statements, bare, in their transaction."""
    _floor.transaction(n, n, str(self.request.id))


@app.task(name="bench.floor_minimal")
def floor_minimal(n: str) -> None:
    """The least any advisory-lock mutex costs: try-lock, unlock."""
    _floor.minimal(n)


CONTENDERS = (
    "plain",
    "session_mutex",
    "session_slot",
    "transaction_slot",
    "once",
    "singleton",
    "floor_mutex",
    "floor_slot",
    "floor_transaction",
    "floor_minimal",
    "contended",
)
CODES = {f"bench.{name}": code for code, name in enumerate(CONTENDERS)}


# -- reporting -----------------------------------------------------------------------------


time_tasks(CODES)


@pglock_signals.task_skipped.connect
def _skipped(sender: Any = None, **_: Any) -> None:
    name = getattr(sender, "name", "")
    report(SKIP_DECIDED, started(), time.monotonic(), CODES.get(name, 0))
