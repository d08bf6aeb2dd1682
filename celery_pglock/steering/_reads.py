"""What the operator's faces show, read once for all of them: the status (``celery pglock
status``, the dashboard's locks page) and one slot's story (``celery pglock why``, the
slot page). Each returns data the JSON of every face is made from, so that the command's
``--json`` and the dashboard's ``/api/…`` answer alike for the same state."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from celery import Celery

from celery_pglock import _controls as controls
from celery_pglock import _slots as slots
from celery_pglock import ops
from celery_pglock._config import app_settings
from celery_pglock.beat._freshness import Freshness, entries_freshness
from celery_pglock.beat._settings import BeatSettings
from celery_pglock.errors import ConfigurationError, NotPgLockScheduler
from celery_pglock.ops import Row
from celery_pglock.steering._apps import (
    Schedule,
    app_tasks,
    known_lock_names,
    lock_of,
    namespace,
    registered_tasks,
    schedule_or_none,
    target,
)
from celery_pglock.store._database import lock_backend
from celery_pglock.store.statements import Statements


def freshness_row(fresh: Freshness) -> Row:
    """One entry's freshness as JSON-ready data."""
    return {
        "entry": fresh.entry,
        "overdue_after": fresh.overdue_after,
        "overdue_seconds": fresh.overdue_by,
        "first_pending": fresh.first_pending,
        "last_success": fresh.last_success,
        "last_success_at": fresh.last_success_at,
        "last_due": fresh.last_due,
    }


@dataclass(frozen=True)
class StatusView:
    """Everything ``celery pglock status`` shows (without a lock name)."""

    found: ops.Status
    paused: list[Row]
    fresh: list[Freshness]
    tasks: list[Row]
    note: str | None  # why freshness is not shown, when the beat schedule did not load
    shadowed: list[str]  # entries beat_schedule and PostgreSQL both define (the code's sent)
    lock_backend: tuple[str, str]  # how the app's processes hold their locks, and why

    def as_json(self) -> Row:
        payload = {**self.found.as_json(), "paused": self.paused, "tasks": self.tasks}
        payload["entries_shadowed"] = self.shadowed
        payload["lock_backend"], payload["lock_backend_why"] = self.lock_backend
        payload["freshness"] = [freshness_row(f) for f in self.fresh]
        result: Row = ops.jsonable(payload)
        return result


def status(app: Celery, statements: Statements, *, skips: int = 10) -> StatusView:
    """Held locks, beat leader and standbys, running runs, recent skips, pauses, the app's
    tasks and its entries' freshness (overdue first)."""
    known = known_lock_names(app)
    found = ops.status(
        statements, namespace=namespace(app), known_names=known, limits=known, skips=skips
    )
    view = controls.Target(statements.tables, found.namespace, ops.operator())
    paused = controls.pauses(statements, view)
    fresh, note, shadowed = freshness(app, statements)
    backend = lock_backend(app_settings(app))
    return StatusView(found, paused, fresh, registered_tasks(app), note, shadowed, backend)


def freshness(app: Celery, statements: Statements) -> tuple[list[Freshness], str | None, list[str]]:
    """Entries with ``pglock_overdue_after``, overdue first; none without a PgLockScheduler.
    The second value says why none are shown when the beat schedule did not load; the
    third names the entries both ``beat_schedule`` and PostgreSQL define."""
    try:
        schedule = Schedule(app, statements)
    except NotPgLockScheduler:
        return [], None, []
    except Exception as exc:  # noqa: BLE001 - an optional section never costs the status
        return [], f"(freshness not shown: the beat schedule did not load: {exc})", []
    settings = BeatSettings.from_app(app)
    fresh = entries_freshness(statements, settings, schedule.entries.values(), schedule.lock_name)
    return fresh, None, schedule.shadowed


def why(
    app: Celery,
    statements: Statements,
    name: str,
    slot: str,
    *,
    resolve: Callable[[str], str] | None = None,
) -> Row:
    """Everything known about one slot of ``name`` (a beat entry, a task or a lock name),
    as ``celery pglock why`` tells it; ``ConfigurationError`` when nothing knows ``name``.
    ``resolve``: how a name that is not an entry becomes a lock name (``lock_of``)."""
    schedule = schedule_or_none(app)
    entry = schedule.entries.get(name) if schedule else None
    if schedule is not None and entry is not None:
        lock = schedule.lock_name(entry)
    else:
        lock = (resolve or (lambda given: lock_of(app, given)))(name)
    found = controls.why(
        statements, target(app, None), lock_name=lock, slot=slot, entry=name if entry else None
    )
    if entry is None and not _known(app, statements, name, lock, found):
        near = difflib.get_close_matches(name, _names(app, schedule), n=3, cutoff=0.5)
        hint = f": did you mean {', '.join(near)}?" if near else ""
        raise ConfigurationError(f"no beat entry, task or lock {name!r} has any slot{hint}")
    found["due"] = _due(entry, slot, app) if entry is not None else None
    return found


def _known(app: Celery, statements: Statements, name: str, lock: str, found: Row) -> bool:
    """Whether ``name`` is something this app or its ledger knows, whatever the slot."""
    if name in app_tasks(app) or lock != name or found["run"] or found["skips"] or found["sends"]:
        return True
    return controls.lock_has_rows(statements, lock)


def _names(app: Celery, schedule: Schedule | None) -> list[str]:
    entries = list(schedule.entries) if schedule else []
    return entries + [task for task in app_tasks(app) if not task.startswith("celery.")]


def _due(entry: Any, slot: str, app: Celery) -> str:
    """Whether ``slot`` is an occurrence of the entry's schedule, and when it fell due."""
    try:
        moment = slots.parse_slot(slot)
    except ValueError:
        return "not a time slot: sent by hand (trigger, or a caller's own slot)"
    align = BeatSettings.from_app(app).align_intervals
    found = slots.next_occurrence(
        entry.schedule, moment - timedelta(seconds=1), align_intervals=align
    )
    if found is None or slots.format_slot(found) != slot:
        return f"no: not an occurrence of {entry.schedule!r}"
    return "yes" if found <= datetime.now(timezone.utc) else "not yet"
