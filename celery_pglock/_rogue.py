"""A stock ``celery beat`` (or an old deploy) still running beside the PgLockScheduler
replicas: its messages carry no slot, so nothing dedupes them: the worker runs each one
(unlocked where the task guards no overlap of ad-hoc messages, as under
``pglock_all_tasks``; else under the lock name, and a slotted message of the same task
arriving meanwhile is skipped ``locked``).

A worker tells: the message has no slot, its task is one a PgLockScheduler leader's entries
send (``beat_tasks``, which the leader refreshes every minute, read here at most once a
minute per process), and the caller did not mark it ad hoc (``apply_async(...,
pglock_adhoc=True)``, the ``pglock_adhoc`` header). Such a message is counted
(``rogue_message`` signal, the metric ``pglock_rogue_messages_total``); once per task and
hour it is logged as a WARNING naming the sender (its ``origin``) and recorded for
``celery pglock status``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from celery_pglock import signals
from celery_pglock._messages import headers_of
from celery_pglock.errors import DatabaseError
from celery_pglock.store._database import Database

logger = logging.getLogger("celery_pglock")

ADHOC_HEADER = "pglock_adhoc"
REFRESH_EVERY = 60.0  # seconds between two reads of the scheduled tasks, per process
LEADER_FRESH = 300.0  # seconds: a leader that refreshed `beat_tasks` since is active
REPORT_EVERY = 3600.0  # seconds: one WARNING (and one row) per task and hour


class RogueWatch:
    """This process's view of which tasks a PgLockScheduler sends, and what it reported."""

    def __init__(self) -> None:
        self._scheduled: frozenset[str] = frozenset()
        self._next_refresh = 0.0
        self._reported: dict[str, float] = {}
        self._lock = threading.Lock()

    def slotless(
        self, task: Any, namespace: str, db: Callable[[], Database], *, locked: bool
    ) -> None:
        """A message of ``task`` arrived without a slot: flag it if a scheduler sends it.
        ``db`` gives the process's ``Database``, asked for only when a look-up is due;
        ``locked``: whether the message runs under the task's lock name."""
        if adhoc(task.request) or task.name not in self._tasks(db, namespace):
            return
        origin = str(getattr(task.request, "origin", None) or "unknown sender")
        signals.rogue_message.send(sender=task, origin=origin)
        now = time.monotonic()
        with self._lock:
            if now < self._reported.get(task.name, -REPORT_EVERY) + REPORT_EVERY:
                return
            self._reported[task.name] = now
        self._report(task.name, namespace, origin, db(), locked=locked)

    def _tasks(self, db: Callable[[], Database], namespace: str) -> frozenset[str]:
        now = time.monotonic()
        if now >= self._next_refresh:
            self._next_refresh = now + REFRESH_EVERY
            params = {"namespace": namespace, "fresh": LEADER_FRESH}
            try:
                with db().statements() as statements:
                    rows = statements.rows("scheduled_tasks", params)
                self._scheduled = frozenset(row["task_name"] for row in rows)
            except DatabaseError:  # keep what we knew; never fail a run
                pass
        return self._scheduled

    def _report(
        self, task_name: str, namespace: str, origin: str, db: Database, *, locked: bool
    ) -> None:
        logger.warning(
            "%s: a message without a slot from %s, while a PgLockScheduler sends this task: is "
            "a stock `celery beat` (or an old deploy) still running? Its runs are %s. Mark "
            "deliberate calls with apply_async(..., pglock_adhoc=True); this warning repeats "
            "at most hourly per worker process",
            task_name,
            origin,
            "locked but not deduplicated per slot" if locked else "neither locked nor deduplicated",
            extra={"action": "pglock_rogue_scheduler", "task": task_name, "origin": origin},
        )
        params = {"namespace": namespace, "task_name": task_name, "origin": origin}
        try:
            with db.statements() as statements:
                statements.run("record_rogue_send", params)
        except DatabaseError:
            pass  # the WARNING is out; the row is only for `status`


def adhoc(request: Any) -> bool:
    """Whether the caller marked the message as a deliberate, slot-less call."""
    marked = headers_of(request).get(ADHOC_HEADER) or getattr(request, ADHOC_HEADER, None)
    return bool(marked)


watch = RogueWatch()
