"""Helpers for acceptance tests that run ``tests.apps.testapp`` in real processes."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
from psycopg import sql

from tests.apps import testapp


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
    }
    env.update({key: str(value) for key, value in extra.items()})
    return env


def configure_client(env: dict[str, str]) -> Any:
    """Point the in-test ``testapp.app`` at the same broker, backend, schema and queue."""
    app = testapp.app
    app.conf.update(
        broker_url=env["TEST_BROKER_URL"],
        result_backend=env["TEST_RESULT_BACKEND"] or None,
        task_default_queue=env["TEST_QUEUE"],
        pglock_dsn=env["PGLOCK_DSN"],
        pglock_schema=env["TEST_SCHEMA"],
    )
    testapp.SCHEMA = env["TEST_SCHEMA"]
    testapp.DSN = env["PGLOCK_DSN"]
    with psycopg.connect(env["PGLOCK_DSN"], autocommit=True) as conn:
        testapp.create_tables(conn)
    return app


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
