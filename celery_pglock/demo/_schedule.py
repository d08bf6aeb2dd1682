"""What the demo app runs: its periodic tasks, their slots, and the environment it reads.

Pure data and arithmetic, shared by the app (in the worker and beat processes) and by the
report (in the demo process), so both agree on every task's name, interval and slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from celery_pglock._slots import format_slot, interval_slot

# Environment the demo process hands to every beat and worker it starts.
ENV_DSN = "PGLOCK_DEMO_DSN"
ENV_SCHEMA = "PGLOCK_DEMO_SCHEMA"
ENV_BROKER = "PGLOCK_DEMO_BROKER"
ENV_LOCK = "PGLOCK_DEMO_LOCK"
ENV_RUN = "PGLOCK_DEMO_RUN"

APP_MODULE = "celery_pglock.demo._app"
BROKER_ALIAS = "pglock-sqla"  # kombu transport alias of ``demo.transport``
SENT_AT_HEADER = "demo_sent_at"
REDELIVERED_HEADER = "demo_redelivered"

LEASE = 3.0  # seconds a frozen task holder keeps its lock (pglock_lease)
BEAT_LEASE = 2.0  # seconds a frozen beat leader keeps leadership (pglock_beat_lease)
RESEND_AFTER = 3.0  # re-send a claim whose sender died before publishing (seconds)


@dataclass(frozen=True)
class DemoTask:
    """One periodic task of the demo app."""

    name: str
    every: float
    runs_for: float
    what: str
    shared_output: bool = False  # every run overwrites one output (the latest report)

    @property
    def short(self) -> str:
        return self.name.rsplit(".", 1)[-1]

    def resource(self, run_id: str, slot: str) -> str:
        """What a run's write is fenced on: its slot's output, or the one shared output."""
        output = self.name if self.shared_output else f"{self.name}@{slot}"
        return f"{namespace(run_id)}:{output}"

    def slot_of(self, moment: float) -> str:
        """The epoch-aligned slot that ``moment`` (a Unix time) falls in."""
        when = datetime.fromtimestamp(moment, timezone.utc)
        return format_slot(interval_slot(when, timedelta(seconds=self.every)))

    def slots_between(self, start: float, end: float) -> list[str]:
        """Slots due in ``(start, end]``: every boundary a beat must fire in that window."""
        first = (int(start // self.every) + 1) * self.every
        count = max(0, int((end - first) // self.every) + 1)
        return [self.slot_of(first + i * self.every) for i in range(count)]


TASKS: tuple[DemoTask, ...] = (
    DemoTask("demo.send_reminders", 1.0, 0.05, "e-mails the reminders due this second"),
    DemoTask("demo.sync_rates", 2.0, 0.2, "refreshes exchange rates"),
    DemoTask("demo.build_report", 2.0, 2.5, "long: still running when its next slot is due", True),
)
TASKS_BY_NAME = {task.name: task for task in TASKS}


def namespace(run_id: str) -> str:
    """The pglock namespace (lock names, beat state) of one demo run."""
    return f"demo-{run_id}"


def queue(run_id: str) -> str:
    """The broker queue of one demo run, so runs never see each other's messages."""
    return f"demo-{run_id}"


def slot_time(slot: str) -> float:
    """The Unix time of a slot id (``2026-11-29T18:05:00Z``)."""
    return datetime.strptime(slot, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()
