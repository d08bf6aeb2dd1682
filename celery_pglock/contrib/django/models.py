"""Unmanaged models over celery-pglock's tables (Django never creates or alters them)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import models

from celery_pglock._config import tables_of


def celery_settings() -> dict[str, Any]:
    """The ``pglock_*`` settings of Django's settings (``CELERY_PGLOCK_*``, the namespace
    ``config_from_object("django.conf:settings", namespace="CELERY")`` reads)."""
    names = ("pglock_schema", "pglock_table_prefix")
    return {name: getattr(settings, f"CELERY_{name.upper()}", None) for name in names}


def table(name: str) -> str:
    """The table's name as Django should quote it: schema-qualified unless ``public``."""
    tables = tables_of(celery_settings())
    schema, prefix = tables.schema, tables.prefix
    if schema == "public":
        return f"{prefix}{name}"
    # Already quoted: Django's PostgreSQL backend then uses it as it is.
    return '"{}"."{}"'.format(schema.replace('"', '""'), f"{prefix}{name}".replace('"', '""'))


def unmanaged(name: str, ordering: str, **more: Any) -> Any:
    """The ``Meta`` of a model over one of celery-pglock's tables: Django never writes it."""
    meta = {"managed": False, "db_table": table(name), "ordering": (ordering,), **more}
    return type("Meta", (), meta)


class Who(models.Model):  # type: ignore[misc]  # Django has no type hints
    """What every row names: the lock and slot, a task's id, its host and pid."""

    lock_name = models.TextField()
    slot = models.TextField(null=True)
    task_id = models.TextField(null=True)
    host = models.TextField(null=True)
    pid = models.IntegerField(null=True)

    shown = "task_id"  # the column that says the most about a row, after lock and slot

    class Meta:
        abstract = True

    def __str__(self) -> str:
        return f"{self.lock_name} {self.slot}: {getattr(self, self.shown)}"


class Run(Who):
    """One row per (lock name, slot): the slot's last attempt and its outcome."""

    # The table's key is (lock_name, slot); Django's admin lists only models with a
    # single-column key, so lock_name stands for it here. The admin never looks a row up
    # by it: the list links to no page of its own.
    lock_name = models.TextField(primary_key=True)
    state = models.TextField()
    attempts = models.IntegerField()
    token = models.BigIntegerField(null=True)
    task_name = models.TextField(null=True)
    entry = models.TextField(null=True)
    sent_by = models.TextField(null=True)
    reason = models.TextField(null=True)
    scheduled_at = models.DateTimeField(null=True)
    started_at = models.DateTimeField(null=True)
    finished_at = models.DateTimeField(null=True)
    updated_at = models.DateTimeField()

    # ``celery_pglock.steer``: may act on the dashboard (pause, resume, trigger, rerun,
    # backfill, release); staff without it only read.
    Meta = unmanaged("runs", "-updated_at", permissions=[("steer", "Can steer periodic jobs")])

    shown = "state"


class Skip(Who):
    """One skipped message: why, and who held the lock or ran the slot."""

    id = models.BigAutoField(primary_key=True)
    reason = models.TextField()
    task_name = models.TextField(null=True)
    holder_task_id = models.TextField(null=True)
    at = models.DateTimeField()

    Meta = unmanaged("skips", "-at")

    shown = "reason"


class Holder(Who):
    """The last holder of each lock key (its session may have ended since)."""

    lock_key = models.BigIntegerField(primary_key=True)
    backend_pid = models.IntegerField()
    token = models.BigIntegerField(null=True)
    since = models.DateTimeField()

    Meta = unmanaged("holders", "-since")

    shown = "task_id"


__all__: list[Any] = ["Holder", "Run", "Skip"]
