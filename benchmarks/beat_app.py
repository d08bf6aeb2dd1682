"""The Celery app the beat benchmarks run in ``celery beat`` subprocesses.

Configured from the environment: ``BENCH_BROKER_URL``, ``PGLOCK_DSN``, ``BENCH_SCHEMA``,
``BENCH_NAMESPACE``, ``BENCH_QUEUE``, ``BENCH_LEASE`` (seconds), ``BENCH_EVERY``
(seconds between slots of the one entry, ``tick``). No worker consumes: the benchmarks
measure when beat claims and sends, which is recorded in PostgreSQL.
"""

from __future__ import annotations

import os

from celery import Celery

ENV = os.environ

app = Celery("bench")
app.conf.update(
    broker_url=ENV.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/0"),
    task_default_queue=ENV.get("BENCH_QUEUE", "bench"),
    broker_connection_retry_on_startup=True,
    beat_scheduler="celery_pglock.beat:PgLockScheduler",
    pglock_dsn=ENV.get("PGLOCK_DSN", ""),
    pglock_schema=ENV.get("BENCH_SCHEMA", "public"),
    pglock_namespace=ENV.get("BENCH_NAMESPACE", "bench"),
    pglock_beat_lease=float(ENV.get("BENCH_LEASE", "5")),
    beat_schedule={"tick": {"task": "bench.noop", "schedule": float(ENV.get("BENCH_EVERY", "1"))}},
)


@app.task(name="bench.noop")
def noop() -> None:
    """Nothing: the benchmarks only send."""
