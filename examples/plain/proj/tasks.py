"""The project's tasks: unchanged by the retrofit (``task_cls`` gives them the lock)."""

from __future__ import annotations

import logging
from typing import Any

from proj.celery import app

logger = logging.getLogger(__name__)


@app.task(bind=True)
def send_reminders(self: Any) -> int | None:
    """Every minute: e-mail the reminders that fell due. Runs once per minute, however many
    beats and workers you run; ``self.pglock`` says which minute (slot) and the fencing token.
    """
    lease = self.pglock
    logger.info("sending reminders for %s (token %s)", lease and lease.slot, lease and lease.token)
    return lease.token if lease else None


@app.task(bind=True)
def nightly_report(self: Any) -> str | None:
    """At 02:00 UTC: build yesterday's report. A second copy of the message is skipped."""
    lease = self.pglock
    logger.info("building the report of %s", lease and lease.slot)
    return lease.slot if lease else None
