"""Helpers for acceptance tests that run ``tests.apps.testapp`` in real processes."""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import uuid
from types import TracebackType
from typing import Any

import psycopg
import sqlalchemy
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from tests.apps import testapp
from tests.fixtures.procs import Proc, Procs, wait_until

WORKER_READY_TIMEOUT = 30.0  # seconds; generous, the machine runs other suites meanwhile
SLOT = "2026-11-29T18:05:00Z"
SLOTTED = {"pglock_slot": SLOT}  # the headers of a message of SLOT
DEADLINE = 30.0  # seconds; generous, the machine runs other suites meanwhile
LONG_LEASE = 120  # seconds: far beyond DEADLINE, so nothing passes by waiting a lease out


def app_env(
    *, pg_dsn: str, schema: str, broker_url: str, backend_url: str | None = None, **extra: Any
) -> dict[str, str]:
    """Environment for a worker/beat subprocess running ``tests.apps.testapp``."""
    env = {
        "PGLOCK_DSN": pg_dsn,
        "TEST_SCHEMA": schema,
        "TEST_BROKER_URL": broker_url,
        "TEST_RESULT_BACKEND": backend_url or "",
        "TEST_QUEUE": f"q-{uuid.uuid4().hex[:10]}",
        # Lock names (and the beat leader's) are database-wide: tests running at once on
        # one server keep apart by namespace, the schema's unless a test names its own.
        "TEST_NAMESPACE": schema,
    }
    env.update({key: str(value) for key, value in extra.items()})
    return env


def redis_app_env(*, pg_dsn: str, schema: str, redis_url: str, **extra: Any) -> dict[str, str]:
    """``app_env`` with Redis as broker and result backend."""
    backend = redis_result_backend(redis_url)
    return app_env(pg_dsn=pg_dsn, schema=schema, broker_url=redis_url, backend_url=backend, **extra)


def configure_broker_client(env: dict[str, str]) -> Any:
    """Point the in-test ``testapp.app`` at the same broker, backend and queue only."""
    app = testapp.app
    _forget_previous_configuration(app)
    database_backend = env["TEST_RESULT_BACKEND"].startswith("db+")
    schemas = {"task": env["TEST_SCHEMA"], "group": env["TEST_SCHEMA"]}
    app.conf.update(
        broker_url=env["TEST_BROKER_URL"],
        result_backend=env["TEST_RESULT_BACKEND"] or None,
        task_default_queue=env["TEST_QUEUE"],
        pglock_dsn=env["PGLOCK_DSN"],
        pglock_schema=env["TEST_SCHEMA"],
        database_table_schemas=schemas if database_backend else None,
    )
    return app


def configure_client(env: dict[str, str]) -> Any:
    """Point the in-test ``testapp.app`` at the same broker, backend, schema and queue, and
    create the tables the test app records its executions in."""
    app = configure_broker_client(env)
    database_backend = env["TEST_RESULT_BACKEND"].startswith("db+")
    testapp.SCHEMA = env["TEST_SCHEMA"]
    testapp.DSN = env["PGLOCK_DSN"]
    with psycopg.connect(env["PGLOCK_DSN"], autocommit=True) as conn:
        testapp.create_tables(conn)
    if database_backend:
        backend: Any = app.backend
        backend.ResultSession().close()  # creates its tables before the workers race to
    return app


def _forget_previous_configuration(app: Any) -> None:
    """Drop the broker pool, queues and result backend built for an earlier test.

    Celery builds them once per process and caches them: without this, a second test in
    the same pytest process would publish to the first test's queue and broker and read
    the first test's result backend.
    """
    app._pool = None  # kombu keeps (and reuses) one open pool per broker URL
    app.__dict__.pop("amqp", None)
    app._backend_cache = None
    app._local.__dict__.pop("backend", None)


def executions(dsn: str, schema: str, task: str | None = None) -> list[dict[str, Any]]:
    """Every recorded execution, oldest first."""
    query = sql.SQL("SELECT * FROM {} {} ORDER BY id").format(
        sql.Identifier(schema, "executions"),
        sql.SQL("WHERE task = %(task)s" if task else ""),
    )
    with (
        psycopg.connect(dsn, autocommit=True) as conn,
        conn.cursor(row_factory=psycopg.rows.dict_row) as cur,
    ):
        return cur.execute(query, {"task": task}).fetchall()


def ledger(dsn: str, schema: str) -> list[dict[str, Any]]:
    """Every run-ledger row."""
    query = sql.SQL("SELECT * FROM {} ORDER BY lock_name, slot").format(
        sql.Identifier(schema, "pglock_runs")
    )
    with (
        psycopg.connect(dsn, autocommit=True) as conn,
        conn.cursor(row_factory=psycopg.rows.dict_row) as cur,
    ):
        return cur.execute(query).fetchall()


def executions_when(dsn: str, schema: str, count: int) -> list[dict[str, Any]]:
    """The executions once there are ``count`` of them, else [] (for ``wait_until``)."""
    rows = executions(dsn, schema)
    return rows if len(rows) == count else []


def observations(dsn: str, schema: str) -> list[dict[str, Any]]:
    """What ``testapp.fenced_gated`` runs found out about their lease, oldest first."""
    query = sql.SQL("SELECT * FROM {}").format(sql.Identifier(schema, "observations"))
    with (
        psycopg.connect(dsn, autocommit=True) as conn,
        conn.cursor(row_factory=psycopg.rows.dict_row) as cur,
    ):
        return cur.execute(query).fetchall()


def writes(dsn: str, schema: str) -> list[tuple[int, str | None]]:
    """The (token, marker) rows written through ``fence()``."""
    query = sql.SQL("SELECT token, marker FROM {} ORDER BY token").format(
        sql.Identifier(schema, "writes")
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [(int(token), marker) for token, marker in conn.execute(query).fetchall()]


def redis_result_backend(redis_url: str) -> str:
    """The Redis result backend for tests: the database after the broker's (1 after 0)."""
    match = re.fullmatch(r"(.*?)(?:/(\d*))?", redis_url.rstrip("/"))
    assert match is not None  # the pattern matches any text
    return f"{match[1]}/{int(match[2] or 0) + 1}"


def database_result_backend(dsn: str) -> str:
    """A ``db+postgresql+psycopg://`` SQLAlchemy result backend URL for a libpq DSN."""
    params = {key: str(value) for key, value in conninfo_to_dict(dsn).items() if value}
    url = sqlalchemy.URL.create(
        "postgresql+psycopg",
        username=params.get("user"),
        password=params.get("password"),
        host=params.get("hostaddr") or params.get("host"),
        port=int(params["port"]) if "port" in params else None,
        database=params.get("dbname"),
    )
    return "db+" + url.render_as_string(hide_password=False)


class Gate:
    """A closed gate for the ``testapp.gated*`` tasks: they wait until it is opened.

    It is a two-key advisory lock held by this connection; ``open()`` (or leaving the
    ``with`` block) releases it. Pass ``gate.id`` to the task.
    """

    def __init__(self, dsn: str) -> None:
        self.id = secrets.randbelow(2**31 - 2) + 1
        self._conn = psycopg.connect(dsn, autocommit=True)
        self._conn.execute("SELECT pg_advisory_lock(%s, %s)", (testapp.GATE_CLASS, self.id))

    def open(self) -> None:
        """Let every waiting (and later) task through."""
        self._conn.close()

    def __enter__(self) -> Gate:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.open()


def start_workers(
    procs: Procs, env: dict[str, str], count: int = 1, *, concurrency: int = 1
) -> list[Proc]:
    """Start ``count`` prefork ``celery worker`` processes on ``env``'s queue; wait until ready.

    Nodes are named ``w<n>-<queue>@host``: unique across tests and queues. Readiness is
    Celery's ``<node> ready.`` line, logged once the worker consumes.
    """
    started = []
    for number in range(1, count + 1):
        node = f"w{number}-{env['TEST_QUEUE']}"
        proc = procs.celery(
            "tests.apps.testapp",
            "worker",
            *("-P", "prefork", "-c", str(concurrency), "-n", f"{node}@%h"),
            *("--without-gossip", "--without-mingle", "--without-heartbeat"),
            *("-l", "info", "-Q", env["TEST_QUEUE"]),
            env=env,
            name=node,
        )
        started.append((node, proc))
    for node, proc in started:
        proc.wait_for_log(f"{node}@{socket.gethostname()} ready.", timeout=WORKER_READY_TIMEOUT)
    return [proc for _, proc in started]


def kill_running_child(dsn: str, schema: str, worker: Proc) -> dict[str, Any]:
    """SIGKILL the pool child running the test's one execution, as the OOM killer would;
    its execution row (pid, token, task id)."""
    [running] = wait_until(
        lambda: executions(dsn, schema), timeout=DEADLINE, message="the first run"
    )
    assert running["pid"] in worker.children()
    os.kill(running["pid"], signal.SIGKILL)
    return running
