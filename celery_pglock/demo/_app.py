"""The demo's Celery app, run by ``celery -A celery_pglock.demo._app beat|worker``.

Configured from the environment the demo process sets (see ``schedule``): with
``PGLOCK_DEMO_LOCK=1`` the tasks use ``PgLockTask`` and beat uses ``PgLockScheduler``;
with ``0`` it is stock Celery (plain tasks, ``PersistentScheduler`` with a schedule file
per beat). Either way every body records its execution with its slot and fencing token.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery, Task
from celery.signals import before_task_publish

from celery_pglock._task import PgLockTask
from celery_pglock.demo import _schedule as schedule
from celery_pglock.demo._store import Recorder

ENV = os.environ
LOCKED = ENV.get(schedule.ENV_LOCK, "1") == "1"
RUN = ENV.get(schedule.ENV_RUN, "local")
SCHEMA = ENV.get(schedule.ENV_SCHEMA, "public")
DSN = ENV.get(schedule.ENV_DSN, "")
BROKER = ENV.get(schedule.ENV_BROKER, "")

if BROKER.startswith(f"{schedule.BROKER_ALIAS}+"):
    from celery_pglock.demo import _transport as transport  # noqa: F401 - registers the broker alias

app = Celery("pglock_demo")
app.conf.update(
    broker_url=BROKER or None,
    task_default_queue=schedule.queue(RUN),
    task_ignore_result=True,
    worker_prefetch_multiplier=1,
    worker_enable_remote_control=False,
    worker_send_task_events=False,
    broker_connection_retry_on_startup=True,
    beat_schedule={t.short: {"task": t.name, "schedule": t.every} for t in schedule.TASKS},
    beat_max_loop_interval=1,
)
if LOCKED:
    app.conf.update(
        pglock_dsn=DSN,
        pglock_schema=SCHEMA,
        pglock_namespace=schedule.namespace(RUN),
        pglock_lease=schedule.LEASE,
        pglock_beat_lease=schedule.BEAT_LEASE,
        pglock_beat_resend_after=schedule.RESEND_AFTER,
        beat_scheduler="celery_pglock.beat:PgLockScheduler",
    )
else:
    app.conf.beat_scheduler = "celery.beat:PersistentScheduler"

BASE: type[Task[Any, Any]] = PgLockTask if LOCKED else Task


@before_task_publish.connect
def _stamp_send_time(headers: dict[str, Any] | None = None, **_: Any) -> None:
    # Stock beat sends no slot: the worker derives it from when the message was sent.
    if headers is not None:
        headers.setdefault(schedule.SENT_AT_HEADER, time.time())


def _header(task: Task[Any, Any], name: str) -> Any:
    headers = getattr(task.request, "headers", None) or {}
    return headers.get(name, getattr(task.request, name, None))


def perform(task: Task[Any, Any], spec: schedule.DemoTask) -> int | None:
    """Record the execution, work for ``spec.runs_for`` seconds, commit the fenced outcome."""
    lease = getattr(task, "pglock", None)
    sent_at = float(_header(task, schedule.SENT_AT_HEADER) or time.time())
    slot = lease.slot if lease is not None and lease.slot else spec.slot_of(sent_at)
    token = lease.token if lease is not None else None
    recorder = Recorder(DSN, SCHEMA, spec.resource(RUN, slot), token)
    recorder.start(
        run=RUN,
        task=spec.name,
        slot=slot,
        task_id=task.request.id,
        pid=os.getpid(),
        redelivered=bool(_header(task, schedule.REDELIVERED_HEADER)),
        sent_at=sent_at,
    )
    time.sleep(spec.runs_for)
    recorder.finish()
    return token


def _spec(name: str) -> schedule.DemoTask:
    return schedule.TASKS_BY_NAME[name]


@app.task(bind=True, base=BASE, name="demo.send_reminders")
def send_reminders(self: Task[Any, Any]) -> int | None:
    """Every second, quick."""
    return perform(self, _spec("demo.send_reminders"))


@app.task(bind=True, base=BASE, name="demo.sync_rates")
def sync_rates(self: Task[Any, Any]) -> int | None:
    """Every two seconds, quick."""
    return perform(self, _spec("demo.sync_rates"))


@app.task(bind=True, base=BASE, name="demo.build_report")
def build_report(self: Task[Any, Any]) -> int | None:
    """Every two seconds, but runs longer: still busy when its next slot is due."""
    return perform(self, _spec("demo.build_report"))
