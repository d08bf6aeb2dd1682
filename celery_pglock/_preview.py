"""The next slots of a beat entry, exactly as every replica computes them, with what a DST
switch does to each (``celery pglock schedule``).

Slots come from ``slots`` (aligned intervals, crontab in the schedule's timezone, solar),
so the preview is the schedule beat will follow. Only crontab entries have wall times a
DST switch can touch: on a day the clocks go forward, a time inside the gap does not exist
(Celery fires it at the same offset after the gap, or not at all when another occurrence
lands there); on a day they go back, a time in the repeated hour exists twice and fires
once, at its first occurrence. Intervals run on UTC boundaries and solar events on the
sun: a DST switch changes neither.

Pure: no database, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone
from typing import Any

from celery.schedules import BaseSchedule, crontab

from celery_pglock import _slots as slots

MAX_PREVIEW = 1000  # slots per entry


@dataclass(frozen=True)
class Occurrence:
    """One upcoming slot: its id, its wall time in the schedule's zone, and a DST note."""

    slot: str
    local: datetime
    note: str | None = None


def upcoming(
    sched: BaseSchedule, after: datetime, count: int, *, align_intervals: bool = True
) -> list[Occurrence]:
    """The first ``count`` slots of ``sched`` strictly after ``after``, with DST notes.

    Empty when this library cannot compute slots for ``sched`` (a custom schedule type, an
    interval with ``pglock_beat_align_intervals = False``).
    """
    zone = slots.schedule_zone(sched)
    found: list[Occurrence] = []
    point = after
    while len(found) < min(count, MAX_PREVIEW):
        following = slots.next_occurrence(sched, point, align_intervals=align_intervals)
        if following is None:
            break
        point = following
        found.append(Occurrence(slots.format_slot(point), point.astimezone(zone)))
    return _with_dst_notes(sched, found) if isinstance(sched, crontab) else found


def _with_dst_notes(sched: crontab, found: list[Occurrence]) -> list[Occurrence]:
    """Note, per DST day, the times a switch drops (on the first occurrence after them)
    or shifts, and those it repeats (on each)."""
    noted: set[date] = set()
    result = []
    for item in found:
        day, wall = item.local.date(), item.local.replace(tzinfo=None)
        note = None
        if switches(day, item.local.tzinfo):
            gone = [t for t in _nominal_times(sched, day) if not _exists(t, item.local.tzinfo)]
            if gone and day not in noted and wall >= max(gone):
                noted.add(day)
                times = ", ".join(f"{t:%H:%M}" for t in gone)
                shifted = "" if _matches(sched, wall) else f"; fires at {item.local:%H:%M %Z}"
                verb = "does" if len(gone) == 1 else "do"
                note = f"DST starts: {times} {verb} not exist this day{shifted}"
                note += "" if shifted else "; not run"
            elif _ambiguous(wall, item.local.tzinfo):
                note = f"DST ends: {wall:%H:%M} happens twice this day; runs once, the first"
        result.append(Occurrence(item.slot, item.local, note))
    return result


def switches(day: date, zone: Any) -> bool:
    """Whether ``zone``'s UTC offset changes during ``day``."""
    start = datetime.combine(day, time(0), zone)
    end = datetime.combine(day + timedelta(days=1), time(0), zone)
    return bool(start.utcoffset() != end.utcoffset())


def _matches(sched: Any, wall: datetime) -> bool:
    return wall.hour in sched.hour and wall.minute in sched.minute


def _nominal_times(sched: Any, day: date) -> list[datetime]:
    """The wall times ``sched`` names on ``day`` (its hour and minute fields)."""
    hours, minutes = sorted(sched.hour), sorted(sched.minute)
    return [datetime.combine(day, time(h, m)) for h in hours for m in minutes]


def _exists(wall: datetime, zone: Any) -> bool:
    """Whether a wall time exists in ``zone`` (not inside a spring-forward gap)."""
    back = wall.replace(tzinfo=zone).astimezone(timezone.utc).astimezone(zone)
    return back.replace(tzinfo=None) == wall


def _ambiguous(wall: datetime, zone: Any) -> bool:
    """A wall time that exists twice (the autumn repeat)."""
    first, second = wall.replace(tzinfo=zone, fold=0), wall.replace(tzinfo=zone, fold=1)
    return bool(first.utcoffset() != second.utcoffset())
