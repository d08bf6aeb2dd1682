"""What the operator commands share: the app's beat entries as its scheduler loads them,
who acts, and sending an entry's slot by name (waiting for its outcome)."""

from __future__ import annotations

import difflib
import time
from dataclasses import dataclass
from typing import Any

import click
from celery import Celery
from celery.utils.imports import symbol_by_name

from celery_pglock import controls, ops
from celery_pglock.beat.entries import entry_lock_name
from celery_pglock.beat.scheduler import EntryWithHeaders, PgLockSchedulerMixin
from celery_pglock.beat.settings import BeatSettings
from celery_pglock.cli.common import Refused, app_tasks, namespace
from celery_pglock.errors import ConfigurationError
from celery_pglock.messages import ENTRY_HEADER, MANUAL_HEADER, SLOT_HEADER, checked_slot
from celery_pglock.schema import Tables
from celery_pglock.sessions import Connection

BY_HELP = "Who acts, for the audit trail [default: user@host]."
FINAL_STATES = ("succeeded", "failed", "skipped")
DELIVERY_TIMEOUT = 60.0  # seconds a slot sent by name may take to end
LOCKED_RETRIES = 5
LOCKED_PAUSE = 0.5  # seconds, times the attempt, before sending a `locked` slot again
POLL = 0.1


class Schedule:
    """The app's beat entries, loaded as its beat scheduler loads them."""

    def __init__(self, app: Celery) -> None:
        app_tasks(app)  # as beat: Django set up, the task modules imported (lock names)
        cls = symbol_by_name(app.conf.beat_scheduler)
        if not (isinstance(cls, type) and issubclass(cls, PgLockSchedulerMixin)):
            raise Refused(
                f"beat_scheduler is {app.conf.beat_scheduler!r}: pausing, triggering and "
                "explaining entries need celery_pglock.beat:PgLockScheduler (or a scheduler "
                "class with PgLockSchedulerMixin first)"
            )
        self.app = app
        scheduler: Any = cls(app=app, lazy=True)
        scheduler.setup_schedule()
        self.scheduler = scheduler
        self.entries: dict[str, Any] = dict(self.scheduler.schedule)

    def entry(self, name: str) -> Any:
        """The entry ``name``, or a ``Refused`` naming the nearest ones."""
        if name in self.entries:
            return self.entries[name]
        near = difflib.get_close_matches(name, list(self.entries), n=3, cutoff=0.5)
        known = near or sorted(self.entries)
        hint = "did you mean" if near else "entries are"
        raise Refused(f"no beat entry {name!r}: {hint} {', '.join(known) or '(none)'}")

    def lock_name(self, entry: Any) -> str:
        return entry_lock_name(self.app, entry)


def target(app: Celery, by: str | None) -> controls.Target:
    settings = BeatSettings.from_app(app)
    return controls.Target(settings.settings.tables, namespace(app), by or ops.operator())


@dataclass(frozen=True)
class Delivery:
    """Slots of one entry sent by name, one at a time, each waited for until final."""

    app: Celery
    conn: Connection
    tables: Tables
    entry: Any
    lock: str

    def run(self, slot: str) -> str:
        """Send ``slot`` and wait until the message is done with; how it ended. A message
        sent while another run of its lock holds it is skipped `locked`: sent again, a
        few times."""
        for attempt in range(1, LOCKED_RETRIES + 1):
            task_id = send(self.app, self.entry, slot)
            ended = self.wait_done(slot, task_id)
            if ended is None:
                return f"sent; not done after {DELIVERY_TIMEOUT:.0f} s (is a worker running?)"
            if ended != "skipped (locked)":
                return ended
            time.sleep(LOCKED_PAUSE * attempt)
        return f"skipped `locked` {LOCKED_RETRIES} times: another run of {self.lock} kept the lock"

    def wait_done(self, slot: str, task_id: str) -> str | None:
        """How message ``task_id`` ended: its attempt's final state, or its skip."""
        deadline = time.monotonic() + DELIVERY_TIMEOUT
        while time.monotonic() < deadline:
            row = controls.run_row(self.conn, self.tables, self.lock, slot)
            if row is not None and row["task_id"] == task_id and row["state"] in FINAL_STATES:
                return str(row["state"]) + (f" ({row['reason']})" if row["reason"] else "")
            skips = controls.skips_of(self.conn, self.tables, self.lock, slot)
            if any(skip["task_id"] == task_id for skip in skips):
                reason = next(s["reason"] for s in skips if s["task_id"] == task_id)
                return f"skipped ({reason})"
            time.sleep(POLL)
        return None


def checked(slot: str) -> str:
    """A slot given on the command line, or a usage error naming what is wrong with it."""
    try:
        return checked_slot("--slot", slot)
    except ConfigurationError as exc:
        raise click.BadParameter(str(exc), param_hint="--slot") from None


def send(app: Celery, entry: Any, slot: str) -> str:
    """Publish ``entry``'s task as beat would, with ``slot`` and the entry's name in its
    headers (so that the worker locks it as the entry's), marked as sent by hand: a slot
    asked for by name is neither superseded by newer slots nor late; the task id."""
    headers = {SLOT_HEADER: slot, ENTRY_HEADER: entry.name, MANUAL_HEADER: True}
    view = EntryWithHeaders(entry, headers)
    sent = app.send_task(entry.task, args=entry.args, kwargs=entry.kwargs, **view.options)
    return str(sent.id)
