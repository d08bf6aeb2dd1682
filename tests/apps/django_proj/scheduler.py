"""django-celery-beat's ``DatabaseScheduler`` with celery-pglock's once-per-slot protection.

``celery beat -S tests.apps.django_proj.scheduler:PgLockDatabaseScheduler`` imports this
module in the beat process only, so Django is set up here, before the models load.
"""

from __future__ import annotations

import os

import django  # type: ignore[import-untyped]

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.apps.django_proj.settings")
django.setup()

from django_celery_beat.schedulers import (  # type: ignore[import-untyped] # noqa: E402
    DatabaseScheduler,  # imported after django.setup()
)

from celery_pglock.beat import PgLockSchedulerMixin  # noqa: E402


class PgLockDatabaseScheduler(PgLockSchedulerMixin, DatabaseScheduler):  # type: ignore[misc]
    """Entries from the Django database; each slot sent once across replicas."""
