"""Settings of the example project: one PostgreSQL for Django, django-celery-beat and the locks.

Environment: ``DATABASE_URL`` (``postgresql://user:password@host:5432/dbname``),
``CELERY_BROKER_URL`` (default ``redis://localhost:6379/0``), ``DJANGO_SECRET_KEY``.
"""

from __future__ import annotations

import os

from celery.schedules import crontab
from psycopg.conninfo import conninfo_to_dict

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@localhost:5432/mysite")
_DB = conninfo_to_dict(DATABASE_URL)

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-only-change-me")
DEBUG = False
ALLOWED_HOSTS: list[str] = []
INSTALLED_APPS = ["django_celery_beat", "billing"]
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _DB.get("dbname", ""),
        "USER": _DB.get("user", ""),
        "PASSWORD": _DB.get("password", ""),
        "HOST": _DB.get("host", ""),
        "PORT": _DB.get("port", ""),
    }
}

CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "redis://localhost:6379/0")
CELERY_TIMEZONE = TIME_ZONE
CELERY_BEAT_SCHEDULE = {
    "refresh-rates": {"task": "billing.tasks.refresh_rates", "schedule": 60.0},
    "nightly-rollup": {
        "task": "billing.tasks.nightly_rollup",
        "schedule": crontab(hour=2, minute=0),
    },
}
CELERY_BEAT_SCHEDULER = "mysite.scheduler:Scheduler"  # celery-pglock: one beat sends each slot
# celery-pglock needs no DSN of its own: it uses DATABASES["default"] (locks and ledger in
# the same database as the app's).
