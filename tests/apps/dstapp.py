"""An app whose beat entries live in Europe/Berlin, for ``pglock schedule`` across DST."""

from __future__ import annotations

import os

from celery import Celery
from celery.schedules import crontab

app = Celery("dstapp")
app.conf.update(
    timezone="Europe/Berlin",
    beat_scheduler="celery_pglock.beat:PgLockScheduler",
    pglock_dsn=os.environ.get("PGLOCK_DSN", ""),
    pglock_schema=os.environ.get("TEST_SCHEMA", "public"),
    beat_schedule={
        "nightly": {"task": "dst.nightly", "schedule": crontab(hour=2, minute=30)},
        "quarter-hours": {"task": "dst.often", "schedule": crontab(hour="1-3", minute="*/15")},
        "hourly": {"task": "dst.hourly", "schedule": 3600.0},
    },
)
