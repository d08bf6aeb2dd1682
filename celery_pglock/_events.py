"""The Celery event a skip sends, ``task-skipped``, for Flower and ``celery events``."""

from __future__ import annotations

import logging
from typing import Any

from celery_pglock._states import SKIPPED

logger = logging.getLogger("celery_pglock")


def send_skipped(task: Any, meta: dict[str, Any]) -> None:
    """Send the ``task-skipped`` event of a skipped message (its meta, and a summary line)."""
    # So Flower and `celery events` show the skip; losing an event must not fail the task.
    # They keep only the fields of Celery's events.state.Task, so the meta's own fields go
    # unseen there: `result` (Flower's "Result", `celery events`' info) says it in one line.
    try:
        task.send_event("task-skipped", retry=False, **{**meta, "result": skip_summary(meta)})
    except Exception:
        logger.debug("could not send the task-skipped event", exc_info=True)


def skip_summary(meta: dict[str, Any]) -> str:
    """``SKIPPED: done (lock 'ns:t', slot 's', holder task t-1 pid 123 on host)``; the
    holder's slot too when not the skipped one (``locked``, ``superseded``)."""
    slot = meta.get("slot")
    parts = [f"lock {meta.get('lock')!r}", "no slot" if slot is None else f"slot {slot!r}"]
    holder = meta.get("holder")
    if isinstance(holder, dict):
        who = [f"holder task {holder.get('task_id') or 'unknown'}"]
        if holder.get("slot") not in (None, slot):
            who.append(f"of slot {holder['slot']!r}")
        if holder.get("pid") is not None:
            who.append(f"pid {holder['pid']}")
        if holder.get("host"):
            who.append(f"on {holder['host']}")
        parts.append(" ".join(who))
    return f"{SKIPPED}: {meta.get('reason')} ({', '.join(parts)})"


__all__ = ["send_skipped", "skip_summary"]
