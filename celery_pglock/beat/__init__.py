"""Beat schedulers that send each slot once, however many replicas run.

- ``PgLockSchedulerMixin`` adds the protection to any scheduler class (Celery's
  ``PersistentScheduler``, django-celery-beat's ``DatabaseScheduler``).
- ``PgLockScheduler`` is a complete scheduler whose state lives in PostgreSQL
  (``celery beat -S pglock``).

The modules, in the order a tick uses them: ``scheduler`` (the tick), ``leader`` (which
replica sends), ``planner`` (which slots are due), ``claims`` (claim before sending,
confirm after), with ``settings`` read once at start-up.
"""

from __future__ import annotations

from celery_pglock.beat._scheduler import PgLockScheduler, PgLockSchedulerMixin

__all__ = ["PgLockScheduler", "PgLockSchedulerMixin"]
