"""Beat schedulers that send each slot once, however many replicas run.

- ``PgLockSchedulerMixin`` adds the protection to any scheduler class (Celery's
  ``PersistentScheduler``, django-celery-beat's ``DatabaseScheduler``).
- ``PgLockScheduler`` is a complete scheduler whose state lives in PostgreSQL
  (``celery beat -S pglock``).

The modules (private), in the order a tick uses them: ``_scheduler`` (the tick),
``_leader`` (which replica sends), ``_stored`` (the entries stored in PostgreSQL),
``_planner`` (which slots are due), ``_claims`` (claim before sending), ``_sending``
(confirm after), with ``_settings`` read once at start-up.
"""

from __future__ import annotations

from celery_pglock.beat._scheduler import PgLockScheduler, PgLockSchedulerMixin

__all__ = ["PgLockScheduler", "PgLockSchedulerMixin"]
