"""Schedule entries that live in PostgreSQL: added, changed and removed at runtime, no
redeploy. Every beat replica of the app's namespace sends a change from its next tick.

::

    from celery_pglock import schedules

    schedules.add(app, "tenant-42-report", "reports.send", cron="0 8 * * mon",
                  tz="Europe/Paris", kwargs={"tenant": 42})
    schedules.update(app, "tenant-42-report", cron="0 9 * * mon")   # only what is given
    schedules.remove(app, "tenant-42-report")
    schedules.ensure(app, "nightly", "billing.close", every="1d")    # at deploy: idempotent

Everything is checked before anything is stored, each error naming the field: a cron
expression that does not parse, an unknown timezone, an interval <= 0, arguments that are
not JSON or larger than 64 KiB, a task the app does not know (``force=True`` for a task
only the workers import). Each change is audited (who: ``by``, default ``user@host``;
before and after). A name also defined in ``beat_schedule`` is the code's: beat sends
that one and warns (see docs/schedules.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery import Celery

from celery_pglock import _entry_specs as specs
from celery_pglock import _entry_store as store
from celery_pglock._config import app_settings
from celery_pglock._entry_store import Entry
from celery_pglock.errors import ConfigurationError
from celery_pglock.steering._apps import namespace, target
from celery_pglock.store.statements import Statements, opened

__all__ = ["Entry", "add", "checked", "ensure", "entries", "get", "merged", "remove", "update"]

LABEL = "celery-pglock schedules"
SCHEDULE_KINDS = ("every", "cron", "at", "solar")
SCHEDULE_FIELDS = (*SCHEDULE_KINDS, "tz", "lat", "lon")


def add(
    app: Celery, name: str, task: str, *, by: str | None = None, force: bool = False, **given: Any
) -> Entry:
    """Store a new entry ``name`` sending ``task``; ``given``: its schedule (``every``,
    ``cron`` [``tz``], ``at``, or ``solar`` with ``lat`` and ``lon``), ``args``,
    ``kwargs``, send options (``queue``, ``exchange``, ``routing_key``, ``priority``,
    ``expires``, ``headers``), the library's (``catch_up``, ``catch_up_limit``,
    ``overdue_after``), ``starts_at``, ``ends_at``, ``enabled``. A name taken is refused."""
    values = checked(app, name, {**given, "task": task}, force=force, now_given=True)
    with _statements(app) as statements:
        return store.write(statements, target(app, by), name, values, "add")


def update(
    app: Celery, name: str, *, by: str | None = None, force: bool = False, **given: Any
) -> Entry:
    """Change entry ``name``: only what ``given`` names changes (a new schedule replaces
    the old one whole). An entry not stored is refused."""
    with _statements(app) as statements:
        before = store.get(statements, namespace(app), name)
        if before is None:
            raise ConfigurationError(f"no entry {name!r} is stored: add it first")
        values = checked(app, name, merged(before, given), force=force, now_given="at" in given)
        return store.write(statements, target(app, by), name, values, "edit")


def ensure(
    app: Celery, name: str, task: str, *, by: str | None = None, force: bool = False, **given: Any
) -> Entry:
    """Code that declares its entries at deploy time: store entry ``name`` as given,
    unchanged (and unaudited) when it already is so; ``add``'s arguments."""
    values = checked(app, name, {**given, "task": task}, force=force, now_given=False)
    with _statements(app) as statements:
        before = store.get(statements, namespace(app), name)
        if before is not None and before.values() == values:
            return before
        return store.write(statements, target(app, by), name, values, "ensure")


def remove(app: Celery, name: str, *, by: str | None = None) -> Entry:
    """Remove entry ``name``: beat sends nothing more of it. What it was."""
    with _statements(app) as statements:
        return store.remove(statements, target(app, by), name)


def get(app: Celery, name: str) -> Entry | None:
    with _statements(app) as statements:
        return store.get(statements, namespace(app), name)


def entries(app: Celery) -> list[Entry]:
    """Every stored entry of the app's namespace, by name."""
    with _statements(app) as statements:
        return store.listed(statements, namespace(app))


def checked(
    app: Celery, name: str, given: dict[str, Any], *, force: bool, now_given: bool
) -> dict[str, Any]:
    """The stored values of an entry made of ``given``, every field checked first.
    ``now_given``: a one-off time given now must lie ahead."""
    specs.entry_name(name)
    task = given.get("task")
    if not isinstance(task, str) or not task:
        raise ConfigurationError("task: the name of the task the entry sends")
    if not force and task not in app.tasks:
        raise ConfigurationError(
            f"task: {task!r} is not a task of this app (is its module imported here?); "
            "pass force=True (--force) for a task only the workers import"
        )
    schedule = specs.schedule_spec(
        every=given.get("every"),
        cron=given.get("cron"),
        tz=given.get("tz"),
        at=given.get("at"),
        solar_event=given.get("solar"),
        lat=given.get("lat"),
        lon=given.get("lon"),
    )
    if now_given and "at" in schedule:
        specs.ahead("at", schedule["at"])
    args, kwargs = specs.arguments(given.get("args"), given.get("kwargs"))
    options = specs.send_options({k: given.get(k) for k in specs.SEND_OPTIONS})
    pglock = specs.pglock_options({k: given.get(k) for k in specs.PGLOCK_OPTIONS}, name)
    starts_at, ends_at = (
        specs.moment(key, given[key]) if given.get(key) is not None else None
        for key in ("starts_at", "ends_at")
    )
    if starts_at and ends_at and ends_at <= starts_at:
        raise ConfigurationError("ends_at: must come after starts_at")
    unknown = sorted(set(given) - KNOWN)
    if unknown:
        raise ConfigurationError(f"unknown field(s) {unknown}: one of {sorted(KNOWN)}")
    return {
        "task": task,
        "schedule": schedule,
        "args": args,
        "kwargs": kwargs,
        "options": options,
        "pglock": pglock,
        "starts_at": starts_at,
        "ends_at": ends_at,
        "enabled": bool(given.get("enabled", True)),
    }


KNOWN = {
    "task",
    "args",
    "kwargs",
    "starts_at",
    "ends_at",
    "enabled",
    *SCHEDULE_FIELDS,
    *specs.SEND_OPTIONS,
    *specs.PGLOCK_OPTIONS,
}


def merged(before: Entry, given: dict[str, Any]) -> dict[str, Any]:
    """``before``'s fields as ``checked`` takes them, with ``given``'s over them; a
    schedule given replaces the stored one whole."""
    found: dict[str, Any] = {"task": before.task, "args": before.args, "kwargs": before.kwargs}
    found |= {"starts_at": before.starts_at, "ends_at": before.ends_at, "enabled": before.enabled}
    found |= before.options | before.pglock
    if not any(given.get(kind) is not None for kind in SCHEDULE_KINDS):
        found |= _schedule_fields(before.schedule)
    return found | given


def _schedule_fields(stored: dict[str, Any]) -> dict[str, Any]:
    if "solar" in stored:
        return {"solar": stored["solar"], "lat": stored["lat"], "lon": stored["lon"]}
    return dict(stored)


@contextmanager
def _statements(app: Celery) -> Iterator[Statements]:
    """Statements of ``app``'s tables, created first if missing (``pglock_auto_migrate``),
    as a worker does: code may store its entries before any worker started."""
    settings = app_settings(app)
    with opened(settings, application_name=LABEL) as statements:
        statements.ensure_schema(auto_migrate=settings.auto_migrate)
        yield statements
