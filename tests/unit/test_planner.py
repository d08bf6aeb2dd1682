"""The planner's looks (``beat._planner``): a tick reads only the entries whose look has
come, so that one with nothing due costs the same at 10,000 entries as at ten; a
changed entry is looked at by the next tick; a removed one is never looked at again."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery
from celery.beat import ScheduleEntry
from celery.schedules import schedule

from celery_pglock._slots import Once
from celery_pglock.beat._planner import SlotPlanner
from celery_pglock.beat._settings import BeatSettings

NOW = datetime(2026, 12, 7, 10, 0, 0, 500_000, tzinfo=timezone.utc)


class CountingPlanner(SlotPlanner):
    """Counts the entries it reads (the work a tick does per entry)."""

    looked = 0

    def _slot_if_due(self, entry: Any, now: datetime) -> str | None:
        self.looked += 1
        return super()._slot_if_due(entry, now)


@pytest.fixture
def app() -> Celery:
    app = Celery("planner", set_as_current=False)
    app.conf.update(pglock_dsn="postgresql://nobody@localhost/none", timezone="UTC")
    return app


def entries(app: Celery, count: int, every: float, prefix: str = "e") -> dict[str, Any]:
    return {
        f"{prefix}{n}": ScheduleEntry(
            f"{prefix}{n}", "t", schedule=schedule(every, app=app), app=app
        )
        for n in range(count)
    }


def planner(app: Celery) -> CountingPlanner:
    return CountingPlanner(BeatSettings.from_app(app), max_interval=5.0)


def lock(entry: Any) -> str:
    return str(entry.name)


def test_a_tick_with_nothing_due_reads_no_entry_however_many_there_are(app: Celery) -> None:
    hourly = entries(app, 10_000, 3600.0)
    looks = planner(app)
    # Ahead of the wall clock, which next_wake reads: a fixed date would pass one day.
    start = NOW.replace(year=2100)
    looks.due(hourly, start, lock)  # every entry seen once: its next look an hour away
    assert 10_000 == looks.looked

    for minute in range(1, 31):  # half an hour of ticks, one a minute
        assert [] == looks.due(hourly, start + timedelta(minutes=minute), lock, rescan=False)

    # No entry read before its look: each at most every LOOK_AT_LEAST_EVERY (300 s).
    assert 10_000 * (1 + 30 * 60 // 300) == looks.looked
    assert 5.0 == looks.next_wake()  # capped at max_interval, however far the next look


def test_the_entries_due_are_read_and_sent_once_each(app: Celery) -> None:
    schedule_ = {**entries(app, 1_000, 3600.0), **entries(app, 1, 2.0, prefix="fast")}
    looks = planner(app)
    looks.due(schedule_, NOW, lock)
    read = looks.looked

    due = looks.due(schedule_, NOW + timedelta(seconds=2), lock, rescan=False)

    assert ["2026-12-07T10:00:02Z"] == [item.slot for item in due]
    assert read + 1 == looks.looked  # the one entry whose look had come


def test_a_changed_entry_is_read_at_the_next_tick_and_a_removed_one_never(app: Celery) -> None:
    schedule_ = entries(app, 3, 3600.0)
    looks = planner(app)
    looks.due(schedule_, NOW, lock)
    read = looks.looked

    looks.changed("e1")
    del schedule_["e2"]
    looks.changed("e2")  # its removal is a change too
    looks.due(schedule_, NOW + timedelta(seconds=1), lock, rescan=False)

    assert read + 1 == looks.looked  # e1 read again; e2, gone, not


def test_a_one_off_first_seen_after_its_time_is_sent_within_the_grace(app: Celery) -> None:
    """A leader elected just after a one-off's time (a failover) still sends it: its only
    slot is never taken for a past occurrence; one older than the grace is missed."""
    at = NOW - timedelta(seconds=2)
    once = ScheduleEntry("once", "t", schedule=Once(at, app=app), app=app)
    old = ScheduleEntry("old", "t", schedule=Once(NOW - timedelta(hours=1), app=app), app=app)

    due = planner(app).due({"once": once, "old": old}, NOW, lock)

    assert [("once", "2026-12-07T09:59:58Z")] == [(d.entry.name, d.slot) for d in due]
