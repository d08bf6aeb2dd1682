"""``pglock schedule``'s preview: the slots beat will send, and what DST does to each."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from celery import Celery
from celery.schedules import crontab, schedule

from celery_pglock._preview import upcoming

APP = Celery("preview", set_as_current=False)
APP.conf.timezone = "Europe/Berlin"
SPRING = datetime(2027, 3, 27, 12, tzinfo=timezone.utc)  # the day before clocks go forward
AUTUMN = datetime(2027, 10, 30, 12, tzinfo=timezone.utc)  # the day before they go back


def notes(sched: Any, after: datetime, count: int) -> list[tuple[str, str, str | None]]:
    return [(o.slot, f"{o.local:%H:%M %Z}", o.note) for o in upcoming(sched, after, count)]


def test_a_wall_time_the_spring_switch_skips_fires_after_the_gap_and_says_so() -> None:
    nightly = crontab(hour=2, minute=30, app=APP)

    assert [
        (
            "2027-03-28T01:30:00Z",
            "03:30 CEST",
            "DST starts: 02:30 does not exist this day; fires at 03:30 CEST",
        ),
        ("2027-03-29T00:30:00Z", "02:30 CEST", None),
    ] == notes(nightly, SPRING, 2)


def test_a_wall_time_the_autumn_switch_repeats_runs_once_and_says_so() -> None:
    nightly = crontab(hour=2, minute=30, app=APP)

    assert [
        (
            "2027-10-31T00:30:00Z",
            "02:30 CEST",
            "DST ends: 02:30 happens twice this day; runs once, the first",
        ),
        ("2027-11-01T01:30:00Z", "02:30 CET", None),
    ] == notes(nightly, AUTUMN, 2)


def test_wall_times_lost_in_the_gap_are_named_on_the_first_occurrence_after_it() -> None:
    quarters = crontab(hour="1-3", minute="*/15", app=APP)
    after_145 = datetime(2027, 3, 28, 0, 50, tzinfo=timezone.utc)

    [first, second] = notes(quarters, after_145, 2)

    assert ("2027-03-28T01:00:00Z", "03:00 CEST") == first[:2]
    assert "02:00, 02:15, 02:30, 02:45 do not exist this day; not run" in str(first[2])
    assert second[2] is None


def test_intervals_run_on_utc_boundaries_without_dst_notes() -> None:
    hourly = schedule(3600)

    found = notes(hourly, SPRING, 24)

    assert 24 == len(found)
    assert all(note is None for _, _, note in found)
    assert "2027-03-27T13:00:00Z" == found[0][0]
