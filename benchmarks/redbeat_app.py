"""The Celery app the celery-redbeat failover benchmark runs in ``celery beat`` subprocesses.

Configured as redbeat's users do: ``beat_scheduler = "redbeat.RedBeatScheduler"``, the
lock in Redis, and either every default (``BENCH_MAX_LOOP`` unset: Celery's 300 s
``beat_max_loop_interval``, so a 1,500 s lock) or ``beat_max_loop_interval = BENCH_MAX_LOOP``
(lock five times that). Environment: ``BENCH_BROKER_URL``, ``BENCH_PREFIX`` (redbeat key prefix),
``BENCH_QUEUE``, ``BENCH_EVERY`` (seconds between sends of the one entry).
"""

from __future__ import annotations

import os

from celery import Celery

ENV = os.environ
BROKER = ENV.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/15")

app = Celery("bench-redbeat")
app.conf.update(
    broker_url=BROKER,
    task_default_queue=ENV.get("BENCH_QUEUE", "bench"),
    broker_connection_retry_on_startup=True,
    beat_scheduler="redbeat.RedBeatScheduler",
    redbeat_redis_url=BROKER,
    redbeat_key_prefix=f"{ENV.get('BENCH_PREFIX', 'pglockbench')}-redbeat:",
    beat_schedule={"tick": {"task": "bench.noop", "schedule": float(ENV.get("BENCH_EVERY", "1"))}},
)
if ENV.get("BENCH_MAX_LOOP"):
    app.conf.beat_max_loop_interval = float(ENV["BENCH_MAX_LOOP"])


@app.task(name="bench.noop")
def noop() -> None:
    """Nothing: only the sends are measured."""
