"""celery-pglock: run each Celery periodic task once, across any number of replicas.

PostgreSQL advisory locks (freed by the server the moment their session ends), a durable
per-slot run ledger, a server-enforced lease for frozen holders, and fencing tokens.
"""

from __future__ import annotations

from celery_pglock import (
    _retrofit,  # noqa: F401 - applies pglock_all_tasks
    _worker,  # noqa: F401 - the worker's signal hooks
)
from celery_pglock import metrics as _metrics  # noqa: F401 - hooks for pglock_metrics
from celery_pglock._fencing import fence
from celery_pglock._keys import lock_key
from celery_pglock._standalone import advisory_lock, run_once
from celery_pglock._states import SKIPPED, WAITING
from celery_pglock._task import PgLockMixin, PgLockTask
from celery_pglock.errors import (
    ConfigurationError,
    DatabaseError,
    DatabaseUnavailable,
    LockLost,
    PgLockError,
    SchemaMissing,
    StaleToken,
    TaskSkipped,
)
from celery_pglock.schema import Tables
from celery_pglock.signals import (
    beat_leader_changed,
    lock_acquired,
    lock_lost,
    task_overdue,
    task_skipped,
)

__version__ = "0.2.0.dev0"  # the one place of the version (pyproject.toml reads it)


def migration_sql(schema: str = "public", table_prefix: str = "pglock_") -> str:
    """The SQL that creates celery-pglock's tables, for a DBA to review and apply."""
    return Tables(schema, table_prefix).full_schema_sql()


__all__ = [
    "SKIPPED",
    "WAITING",
    "ConfigurationError",
    "DatabaseError",
    "DatabaseUnavailable",
    "LockLost",
    "PgLockError",
    "PgLockMixin",
    "PgLockTask",
    "SchemaMissing",
    "StaleToken",
    "TaskSkipped",
    "__version__",
    "advisory_lock",
    "beat_leader_changed",
    "fence",
    "lock_acquired",
    "lock_key",
    "lock_lost",
    "migration_sql",
    "run_once",
    "task_overdue",
    "task_skipped",
]
