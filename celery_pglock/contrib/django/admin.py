"""The ledger in the admin: lists to search and filter, nothing to change."""

from __future__ import annotations

from typing import Any

from django.contrib import admin

from celery_pglock.contrib.django.models import Holder, Run, Skip


class ReadOnly(admin.ModelAdmin):  # type: ignore[misc]  # Django has no type hints
    """Viewing only: celery-pglock alone writes these tables."""

    list_display_links = None  # no page per row (Run's key is two columns)

    def has_add_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: Any, obj: Any = None) -> bool:
        return False


@admin.register(Run)
class RunAdmin(ReadOnly):
    list_display = (
        "lock_name",
        "slot",
        "state",
        "attempts",
        "token",
        "host",
        "pid",
        "task_id",
        "reason",
        "started_at",
        "finished_at",
    )
    list_filter = ("state", "task_name", "entry")
    search_fields = ("lock_name", "slot", "task_id")


@admin.register(Skip)
class SkipAdmin(ReadOnly):
    list_display = ("at", "lock_name", "slot", "reason", "task_id", "holder_task_id", "host", "pid")
    list_filter = ("reason", "task_name")
    search_fields = ("lock_name", "slot", "task_id", "holder_task_id")


@admin.register(Holder)
class HolderAdmin(ReadOnly):
    list_display = ("lock_name", "slot", "task_id", "host", "pid", "token", "since")
    search_fields = ("lock_name", "task_id")
