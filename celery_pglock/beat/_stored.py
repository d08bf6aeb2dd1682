"""The schedule entries stored in PostgreSQL (``celery_pglock.schedules``), as a beat
replica holds them beside its own.

The leader reads one number at its ticks (at most every ``ENTRY_CHECK_EVERY``), the
namespace's newest change; only when it moved does it read the entries changed since
(added, edited, removed), so a tick costs no more with 100,000 entries than with ten. A
replica that starts leading reads them all first.
An entry's change takes effect at once: its next slot follows its new schedule, and a
removed one sends nothing more. A name also in ``beat_schedule`` is the code's: the
stored one is not sent, and a WARNING says so once.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from celery.beat import ScheduleEntry

from celery_pglock import _entry_store as entry_store
from celery_pglock._entry_specs import PGLOCK_OPTIONS, celery_schedule
from celery_pglock._entry_store import Entry
from celery_pglock._ledger import RunQuery

logger = logging.getLogger("celery_pglock.beat")


@dataclass(frozen=True)
class Window:
    """When a stored entry may send, read by the planner as django-celery-beat's model
    (switched on: a disabled one's slots are recorded paused by the claim instead)."""

    start_time: datetime | None
    expires: datetime | None
    enabled: bool = True


class StoredEntry(ScheduleEntry):
    """A Celery schedule entry stored in PostgreSQL; its ``model`` (kept by ``next``, as
    every attribute) is its window. Disabled, its slots are still claimed, and recorded
    ``paused`` (``beat_claim``), as a paused entry's are: ``runs`` and ``why`` show them."""

    stored = True

    def __init__(self, *args: Any, model: Window | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.model = model


class StoredEntries:
    """The stored entries of one namespace, by name, as Celery schedule entries."""

    def __init__(self, app: Any, namespace: str, *, quiet: bool = False) -> None:
        self.app = app
        self.namespace = namespace
        self._quiet = quiet  # a reader's, not beat's: names shadowed are its to show
        self.version = 0  # the newest change read
        self.entries: dict[str, Any] = {}
        self._shadowed: set[str] = set()  # names the code defines too, said once

    def refresh(self, run_query: RunQuery, code: Collection[str]) -> list[str]:
        """Read what changed since the last call; the names changed (added, edited or
        removed), for the planner to look at them afresh. ``code``: the names
        ``beat_schedule`` defines, whose stored namesakes are not sent."""
        version, changed = entry_store.changes(run_query, self.namespace, self.version)
        now = self.app.now()  # once: Celery's entry would read the clock for each
        for entry in changed:
            if entry.removed:
                self.entries.pop(entry.name, None)
            else:
                self.entries[entry.name] = self._celery_entry(entry, now)
                self._warn_if_shadowed(entry.name, code)
        self.version = version
        return [entry.name for entry in changed]

    def beside(self, code: Mapping[str, Any]) -> Mapping[str, Any]:
        """Every entry to send: ``code``'s, and the stored ones whose name it does not
        define; a view, read as it is now (Celery's ``reserve`` replaces entries)."""
        return Entries(code, self.entries)

    def _celery_entry(self, entry: Entry, now: datetime) -> Any:
        options = dict(entry.options)
        options |= {PGLOCK_OPTIONS[key]: value for key, value in entry.pglock.items()}
        return StoredEntry(
            name=entry.name,
            task=entry.task,
            schedule=celery_schedule(entry.schedule, self.app),
            args=tuple(entry.args),
            kwargs=dict(entry.kwargs),
            options=options,
            last_run_at=now,
            app=self.app,
            model=Window(entry.starts_at, entry.ends_at),
        )

    def _warn_if_shadowed(self, name: str, code: Collection[str]) -> None:
        if self._quiet or name not in code or name in self._shadowed:
            return
        self._shadowed.add(name)
        logger.warning(
            "schedule entry %r is both in beat_schedule and stored in PostgreSQL: the "
            "beat_schedule one is sent; rename or remove the stored one (`celery pglock "
            "entries rm %s`)",
            name,
            name,
            extra={"action": "pglock_beat_entry_shadowed", "entry": name},
        )


class Entries(Mapping[str, Any]):
    """The code's entries and the stored ones beside them (the code's win a name)."""

    def __init__(self, code: Mapping[str, Any], stored: Mapping[str, Any]) -> None:
        self._code = code
        self._stored = stored

    def __getitem__(self, name: str) -> Any:
        if name in self._code:
            return self._code[name]
        return self._stored[name]

    def __iter__(self) -> Iterator[str]:
        yield from self._code
        yield from (name for name in self._stored if name not in self._code)

    def __len__(self) -> int:
        return sum(1 for _ in self)
