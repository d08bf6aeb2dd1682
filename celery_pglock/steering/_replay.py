"""Slots sent by name: one triggered now, past ones sent again (backfill), a succeeded
one run once more (rerun), and how they go out (a ``Send``: waiting for each, in the
background, or published once). What is sent and audited is ``steering.actions``'; the
writes themselves are ``celery_pglock._controls``'."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from celery import Celery

from celery_pglock import _controls as controls
from celery_pglock import _slots as slots
from celery_pglock.beat._settings import BeatSettings
from celery_pglock.errors import ConfigurationError, PgLockError
from celery_pglock.ops import Row
from celery_pglock.steering._apps import Schedule, send
from celery_pglock.store.statements import Statements

if TYPE_CHECKING:
    from celery_pglock.steering._operator import Operator

logger = logging.getLogger("celery_pglock.steering")

#: How an action's slots go out: ``send(operator, entry, lock, plan)``, the plan's items
#: ``{"slot": …, "action": "send" | "skip"}``; a sender that waits sets each ``outcome``.
Send = Callable[["Operator", Any, str, list[dict[str, Any]]], None]

FINAL_STATES = ("succeeded", "failed", "skipped")
DELIVERY_TIMEOUT = 60.0  # seconds a slot sent by name may take to end
LOCKED_RETRIES = 5
LOCKED_PAUSE = 0.5  # seconds, times the attempt, before sending a `locked` slot again
POLL = 0.1


@dataclass(frozen=True)
class Delivery:
    """Slots of one entry sent by name, one at a time, each waited for until final."""

    app: Celery
    statements: Statements
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
            row = controls.run_row(self.statements, self.lock, slot)
            if row is not None and row["task_id"] == task_id and row["state"] in FINAL_STATES:
                return str(row["state"]) + (f" ({row['reason']})" if row["reason"] else "")
            skips = controls.skips_of(self.statements, self.lock, slot)
            if any(skip["task_id"] == task_id for skip in skips):
                reason = next(s["reason"] for s in skips if s["task_id"] == task_id)
                return f"skipped ({reason})"
            time.sleep(POLL)
        return None


def slots_between(app: Celery, entry: Any, start: datetime, end: datetime, limit: int) -> list[str]:
    """The slots of ``entry`` in ``[start, end]``, oldest first; ``ConfigurationError``
    when there are more than ``limit``."""
    align = BeatSettings.from_app(app).align_intervals
    found: list[str] = []
    point: datetime | None = start - timedelta(microseconds=1)
    while point is not None:
        point = slots.next_occurrence(entry.schedule, point, align_intervals=align)
        if point is None or point > end:
            break
        if len(found) == limit:
            raise ConfigurationError(
                f"{start:%Y-%m-%dT%H:%M:%SZ}..{end:%Y-%m-%dT%H:%M:%SZ} holds more than "
                f"--limit {limit} slots of {entry.name}: narrow the range or raise --limit"
            )
        found.append(slots.format_slot(point))
    return found


def plan(rows: dict[str, Row], wanted: list[str]) -> list[dict[str, Any]]:
    """What a backfill of ``wanted`` does with each slot: send it, or skip it (it
    succeeded or runs now), and why; ``rows``: their ledger rows (``slot_rows``)."""
    found = []
    for slot in wanted:
        row = rows.get(slot)
        state = row["state"] if row else None
        if state in ("succeeded", "running"):
            why = f"{state} (token {row['token']})" if row else state
            found.append({"slot": slot, "action": "skip", "why": why})
        else:
            why = f"was {state}" + (f" ({row['reason']})" if row and row["reason"] else "")
            found.append({"slot": slot, "action": "send", "why": why if row else "never ran"})
    return found


def send_plan(found: list[dict[str, Any]], delivery: Delivery, rate: float) -> None:
    """Send the plan's slots, oldest first, each once the one before ended, at most
    ``rate`` per second; each sent slot gets its ``outcome``."""
    next_send = 0.0
    for item in found:
        if item["action"] != "send":
            continue
        time.sleep(max(0.0, next_send - time.monotonic()))
        next_send = time.monotonic() + 1 / rate
        item["outcome"] = delivery.run(item["slot"])


def entry_of(entries: Schedule, name: str) -> tuple[Any, str]:
    """The beat entry behind ``name`` (an entry's name, or the lock name of one)."""
    if name in entries.entries:
        entry = entries.entries[name]
        return entry, entries.lock_name(entry)
    for entry in entries.entries.values():
        if entries.lock_name(entry) == name:
            return entry, name
    raise ConfigurationError(
        f"{name!r} is neither a beat entry nor the lock of one: rerun sends an entry's task "
        f"again (entries: {', '.join(sorted(entries.entries)) or '(none)'})"
    )


def sending(chosen: list[str]) -> list[dict[str, Any]]:
    """A plan that sends each of the ``chosen`` slots."""
    return [{"slot": slot, "action": "send"} for slot in chosen]


def waiting_for_each(rate: float = math.inf) -> Send:
    """Send in the foreground, one slot at a time, each once the one before ended, at most
    ``rate`` a second (``send_plan``); each sent item gets its ``outcome``."""

    def deliver(op: Operator, entry: Any, lock: str, plan: list[dict[str, Any]]) -> None:
        with op.connection() as statements:
            send_plan(plan, Delivery(op.app, statements, entry, lock), rate)

    return deliver


def in_background(rate: float = math.inf) -> Send:
    """As ``waiting_for_each``, in a thread of its own: the caller answers at once, the
    ledger and the audit trail show the outcomes; a failure is logged."""
    foreground = waiting_for_each(rate)

    def deliver(op: Operator, entry: Any, lock: str, plan: list[dict[str, Any]]) -> None:
        def run() -> None:
            try:
                foreground(op, entry, lock, plan)
            except PgLockError:
                logger.exception("sending %s slots by name stopped", entry.name)

        threading.Thread(target=run, name="pglock-send", daemon=True).start()

    return deliver


def published(op: Operator, entry: Any, lock: str, plan: list[dict[str, Any]]) -> None:
    """Publish each slot to send once, now, without waiting for its outcome."""
    for item in plan:
        if item["action"] == "send":
            send(op.app, entry, item["slot"])
