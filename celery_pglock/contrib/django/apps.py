from __future__ import annotations

from django.apps import AppConfig


class PgLockConfig(AppConfig):  # type: ignore[misc]  # Django has no type hints
    name = "celery_pglock.contrib.django"
    label = "celery_pglock"
    verbose_name = "celery-pglock ledger"
