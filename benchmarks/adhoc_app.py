"""The app of ``benchmarks.adhoc``: one no-op task, retrofitted as README.md says.

``BENCH_MODE`` picks the configuration: ``plain`` (stock Celery), ``readme`` (README's
retrofit lines: ``pglock_all_tasks = True``) or ``message`` (the same plus
``pglock_slot = "message"``: each message's task id is its slot, redeliveries skipped).
Each worker process reports every task through the FIFO ``BENCH_FIFO``
(``benchmarks.records``).
"""

from __future__ import annotations

import os

from celery import Celery

import celery_pglock  # noqa: F401 - README's first line
from benchmarks.records import time_tasks

ENV = os.environ
MODES = ("plain", "readme", "message")
MODE = ENV.get("BENCH_MODE", "plain")
TASK = "bench.noop"

app = Celery("pglockadhoc")
app.conf.update(
    broker_url=ENV.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/7"),
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    pglock_dsn=ENV.get("PGLOCK_DSN", ""),
    pglock_schema=ENV.get("BENCH_SCHEMA", "public"),
    pglock_namespace=ENV.get("BENCH_PREFIX", "pglockadhoc"),
)
if MODE != "plain":
    app.conf.pglock_all_tasks = True
if MODE == "message":
    app.conf.pglock_slot = "message"


@app.task(name=TASK)
def noop(n: str) -> None:
    """A plain task of the project: it does nothing."""


time_tasks({TASK: MODES.index(MODE)})
