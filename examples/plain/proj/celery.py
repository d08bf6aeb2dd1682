"""The Celery app. The three lines marked ``celery-pglock`` are the whole retrofit."""

from __future__ import annotations

import os

from celery import Celery
from celery.schedules import crontab

app = Celery(
    "proj",
    include=["proj.tasks"],
    task_cls="celery_pglock:PgLockTask",  # celery-pglock: every task runs once per slot
)
app.conf.update(
    broker_url=os.environ.get("CELERY_BROKER_URL", "redis://localhost:6379/0"),
    timezone="UTC",
    beat_schedule={
        "send-reminders": {"task": "proj.tasks.send_reminders", "schedule": 60.0},
        "nightly-report": {
            "task": "proj.tasks.nightly_report",
            "schedule": crontab(hour=2, minute=0),
        },
    },
)
app.conf.beat_scheduler = "celery_pglock.beat:PgLockScheduler"  # celery-pglock: one beat sends
app.conf.pglock_dsn = os.environ.get("DATABASE_URL")  # celery-pglock: the PostgreSQL you have
