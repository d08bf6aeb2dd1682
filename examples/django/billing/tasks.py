"""Periodic tasks on ``PgLockTask``: each slot runs once, whatever the replicas do."""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task
from django.db import connection, transaction
from django.utils import timezone

from billing.models import Rollup
from celery_pglock import PgLockTask, fence

logger = logging.getLogger(__name__)


@shared_task(bind=True, base=PgLockTask)
def refresh_rates(self: Any) -> None:
    """Every minute; a duplicate message for the same minute is skipped, not run."""
    logger.info("refreshing exchange rates for %s", self.pglock.slot)


@shared_task(bind=True, base=PgLockTask)
def nightly_rollup(self: Any) -> int:
    """Write the rollup of the slot; ``fence`` refuses it if a newer holder already wrote."""
    lease = self.pglock
    with transaction.atomic():
        fence(connection, "billing.rollup", lease.token)
        rollup = Rollup.objects.create(
            slot=lease.slot or timezone.now().isoformat(), token=lease.token
        )
    return rollup.pk
