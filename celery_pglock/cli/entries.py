"""What the operator commands share: sending an entry's slot by name and waiting for its
outcome, a slot given on the command line. The entries themselves: ``steering.apps``."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import click
from celery import Celery

from celery_pglock import controls
from celery_pglock.errors import ConfigurationError
from celery_pglock.messages import checked_slot
from celery_pglock.schema import Tables
from celery_pglock.sessions import Connection
from celery_pglock.steering.apps import send

BY_HELP = "Who acts, for the audit trail [default: user@host]."
FINAL_STATES = ("succeeded", "failed", "skipped")
DELIVERY_TIMEOUT = 60.0  # seconds a slot sent by name may take to end
LOCKED_RETRIES = 5
LOCKED_PAUSE = 0.5  # seconds, times the attempt, before sending a `locked` slot again
POLL = 0.1


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
