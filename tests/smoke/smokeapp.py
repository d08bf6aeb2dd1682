"""The Celery app the smoke test runs in a real ``celery worker``: one locked task.

It imports nothing but Celery, psycopg and celery_pglock, so it runs against an installed
wheel as well as the source tree. Configured from the environment (``configure``):
``SMOKE_BROKER_URL``, ``SMOKE_RESULT_BACKEND``, ``SMOKE_QUEUE``, ``PGLOCK_DSN`` and
``SMOKE_SCHEMA`` (the test's own schema: celery-pglock's tables and ``runs``, which the
task writes to with plain psycopg).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import psycopg
from celery import Celery
from psycopg import sql

from celery_pglock import PgLockTask

app = Celery("smokeapp", set_as_current=False)  # imported by a whole test session too


def configure(env: Mapping[str, str]) -> None:
    """Point ``app`` at the broker, result backend, queue, database and schema in ``env``."""
    schema = env.get("SMOKE_SCHEMA", "public")
    app.conf.update(
        broker_url=env.get("SMOKE_BROKER_URL", "redis://127.0.0.1:6379/0"),
        result_backend=env.get("SMOKE_RESULT_BACKEND") or None,
        task_default_queue=env.get("SMOKE_QUEUE", "celery"),
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        pglock_dsn=env.get("PGLOCK_DSN", ""),
        pglock_schema=schema,
        pglock_namespace=schema,  # lock names are database-wide: keep apart from other runs
    )


def runs_table(schema: str) -> sql.Composable:
    """The table every execution of ``record`` adds a row to."""
    return sql.Identifier(schema, "runs")


@app.task(bind=True, base=PgLockTask, name="smokeapp.record")
def record(self: PgLockTask) -> str:
    """Record this execution (task id, slot header, worker pid) and return the task id."""
    slot = (self.request.headers or {}).get("pglock_slot")
    with psycopg.connect(app.conf.pglock_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("INSERT INTO {} (task_id, slot, pid) VALUES (%s, %s, %s)").format(
                runs_table(app.conf.pglock_schema)
            ),
            (self.request.id, slot, os.getpid()),
        )
    return str(self.request.id)


configure(os.environ)
