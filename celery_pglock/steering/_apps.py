"""The Celery app as the operator's faces see it: its tasks as a worker registers them,
their lock names, the beat entries as its scheduler loads them, who acts, and sending an
entry's slot by name."""

from __future__ import annotations

import difflib
import os
import sys
import weakref
from collections.abc import Mapping
from typing import Any

from celery import Celery
from celery.utils.imports import symbol_by_name

from celery_pglock import _controls as controls
from celery_pglock import _policy as policy
from celery_pglock import ops
from celery_pglock._config import app_settings, namespace_of
from celery_pglock._keys import lock_key
from celery_pglock._messages import BUILTIN_PREFIX, ENTRY_HEADER, MANUAL_HEADER, SLOT_HEADER
from celery_pglock._names import fixed_lock_name
from celery_pglock._task import PgLockMixin
from celery_pglock.beat._entries import entry_lock_name
from celery_pglock.beat._scheduler import EntryWithHeaders, PgLockSchedulerMixin
from celery_pglock.beat._settings import BeatSettings
from celery_pglock.beat._stored import StoredEntries
from celery_pglock.errors import (
    ConfigurationError,
    DatabaseError,
    NotPgLockScheduler,
    UnknownEntry,
)
from celery_pglock.store.statements import Statements, opened


def setup_django() -> None:
    """In a Django project, load its apps as ``celery worker`` and ``celery beat`` do (their
    Django fixup): a command line gets no such step, and django-celery-beat's models need it."""
    if not os.environ.get("DJANGO_SETTINGS_MODULE") or "django" not in sys.modules:
        return
    import django  # noqa: PLC0415 - only in a Django project
    from django.apps import apps  # noqa: PLC0415

    if not apps.ready:
        django.setup()


_loaded: weakref.WeakSet[Celery] = weakref.WeakSet()  # apps whose task modules were imported


def app_tasks(app: Celery) -> Mapping[str, Any]:
    """The app's tasks as its worker registers them: its task modules imported first
    (``imports``, ``include``, Django's autodiscovery), as ``celery worker`` and ``celery
    beat`` do at start-up; once per process."""
    if app not in _loaded:
        setup_django()
        app.loader.import_default_modules()
        _loaded.add(app)
    return app.tasks


def namespace(app: Celery) -> str:
    """The app-wide lock namespace (``pglock_namespace``, else the app's main name)."""
    return namespace_of(app.conf, app.main)


def task_lock_name(app: Celery, task_name: str) -> str | None:
    """The lock name of a registered locked task, when it does not depend on arguments."""
    task = app_tasks(app).get(task_name)
    if not isinstance(task, PgLockMixin):
        return None
    try:
        options = task.pglock_options()
    except ConfigurationError:
        return None
    return fixed_lock_name(task_name, options)


def registered_tasks(app: Celery) -> list[dict[str, Any]]:
    """The app's tasks (not Celery's own): locked or not, and how, for ``status``."""
    found = []
    for name, task in sorted(app_tasks(app).items()):
        if name.startswith(BUILTIN_PREFIX):
            continue
        row: dict[str, Any] = {"task": name, "locked": isinstance(task, PgLockMixin)}
        if isinstance(task, PgLockMixin):
            try:
                options = task.pglock_options()
            except ConfigurationError as exc:
                row["error"] = str(exc)
            else:
                row["lock"] = task_lock_name(app, name) or "(from the arguments)"
                row["locks"] = policy.describe(options)
                row["scope"] = options.scope
                row["scheduled_only"] = options.scheduled_only
        found.append(row)
    return found


def known_lock_names(app: Celery) -> dict[str, int]:
    """Lock names this app's tasks use, so their locks are named even before any run,
    each with its ``pglock_concurrency`` (how many keys it has)."""
    found: dict[str, int] = {}
    for task_name, task in list(app_tasks(app).items()):
        name = task_lock_name(app, task_name)
        if name and isinstance(task, PgLockMixin):
            found[name] = max(found.get(name, 1), task.pglock_options().concurrency)
    return dict(sorted(found.items()))


def lock_of(app: Celery, name: str) -> str:
    """A lock name, or a registered task name turned into its lock name."""
    try:
        lock_key(name)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(str(exc)) from None
    return task_lock_name(app, name) or name


class Schedule:
    """The app's beat entries, loaded as its beat scheduler loads them: ``beat_schedule``'s
    (or django-celery-beat's) and those stored in PostgreSQL (``celery_pglock.schedules``;
    a name both define is the code's, and listed in ``shadowed``). ``statements``: where
    to read the stored ones (else a connection of its own; none when unreachable)."""

    def __init__(self, app: Celery, statements: Statements | None = None) -> None:
        app_tasks(app)  # as beat: Django set up, the task modules imported (lock names)
        cls = symbol_by_name(app.conf.beat_scheduler)
        if not (isinstance(cls, type) and issubclass(cls, PgLockSchedulerMixin)):
            raise NotPgLockScheduler(
                f"beat_scheduler is {app.conf.beat_scheduler!r}: pausing, triggering and "
                "explaining entries need celery_pglock.beat:PgLockScheduler (or a scheduler "
                "class with PgLockSchedulerMixin first)"
            )
        self.app = app
        scheduler: Any = cls(app=app, lazy=True)
        scheduler.setup_schedule()
        self.scheduler = scheduler
        code = dict(self.scheduler.schedule)
        stored = _stored_entries(app, code, statements)
        self.shadowed = sorted(stored.keys() & code.keys())
        self.entries: dict[str, Any] = {**stored, **code}

    def entry(self, name: str) -> Any:
        """The entry ``name``, or ``UnknownEntry`` naming the nearest ones."""
        if name in self.entries:
            return self.entries[name]
        near = difflib.get_close_matches(name, list(self.entries), n=3, cutoff=0.5)
        known = near or sorted(self.entries)
        hint = "did you mean" if near else "entries are"
        raise UnknownEntry(f"no beat entry {name!r}: {hint} {', '.join(known) or '(none)'}")

    def lock_name(self, entry: Any) -> str:
        return entry_lock_name(self.app, entry)


def _stored_entries(
    app: Celery, code: Mapping[str, Any], statements: Statements | None
) -> dict[str, Any]:
    """The app's entries stored in PostgreSQL, as Celery entries; none where the server
    cannot tell (unreachable, or tables older than the entries': the caller's own
    statements then meet the same)."""
    found = StoredEntries(app, namespace(app), quiet=True)
    try:
        if statements is not None:
            found.refresh(statements.rows, code.keys())
        else:
            with opened(app_settings(app)) as own:
                found.refresh(own.rows, code.keys())
    except DatabaseError:
        return {}
    return found.entries


def schedule_or_none(app: Celery) -> Schedule | None:
    """The app's beat entries; None when its scheduler is not a PgLockScheduler."""
    try:
        return Schedule(app)
    except NotPgLockScheduler:  # lock and task names still work
        return None


def target(app: Celery, by: str | None) -> controls.Target:
    """Where a control acts for ``app``, and who acts (default: ``user@host``)."""
    settings = BeatSettings.from_app(app)
    return controls.Target(settings.settings.tables, namespace(app), by or ops.operator())


def send(app: Celery, entry: Any, slot: str) -> str:
    """Publish ``entry``'s task as beat would, with ``slot`` and the entry's name in its
    headers (so that the worker locks it as the entry's), marked as sent by hand: a slot
    asked for by name is neither superseded by newer slots nor late; the task id."""
    headers = {SLOT_HEADER: slot, ENTRY_HEADER: entry.name, MANUAL_HEADER: True}
    view = EntryWithHeaders(entry, headers)
    sent = app.send_task(entry.task, args=entry.args, kwargs=entry.kwargs, **view.options)
    return str(sent.id)
