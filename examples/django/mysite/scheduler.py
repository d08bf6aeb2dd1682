"""django-celery-beat's scheduler, with each slot sent by one beat replica only.

Entries still come from the database (the admin, ``PeriodicTask`` rows, ``CELERY_BEAT_SCHEDULE``);
the mixin adds leader election and the per-slot send log in PostgreSQL.
"""

from __future__ import annotations

from django_celery_beat.schedulers import DatabaseScheduler

from celery_pglock.beat import PgLockSchedulerMixin


class Scheduler(PgLockSchedulerMixin, DatabaseScheduler):
    """``CELERY_BEAT_SCHEDULER = "mysite.scheduler:Scheduler"``."""
