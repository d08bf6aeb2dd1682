"""Slots: the identity of one beat occurrence.

A slot is the *nominal* fire time of a schedule occurrence, as a UTC ISO-8601 string with
second precision (``2026-11-29T18:05:00Z``). It is a pure function of the schedule and the
clock reading, so every beat replica computes the same slot for the same occurrence,
whenever it started:

- plain intervals (``schedule(run_every=...)``) are aligned to epoch boundaries (integer
  multiples of the interval since 1970-01-01T00:00:00Z; a day interval therefore ticks at
  UTC midnight), instead of Celery's per-process phase;
- crontab occurrences are the times Celery's own ``remaining_delta`` chain yields for a
  beat running continuously in the schedule's timezone, DST included: a wall time that
  does not exist (spring forward) fires at the same offset after the gap (02:30 -> 03:30,
  and a ``*/15`` schedule fires 02:00 as 03:00 and skips 02:15-02:45); a repeated wall
  time (fall back) fires once, at its first occurrence;
- solar events are rounded to the nearest minute; each event is recomputed from a start
  derived from its own hour, so replicas agree although ephem's result depends slightly
  on where its search starts.

Clock skew: two replicas reading 18:05:00.2 and 18:05:02.9 both get ``18:05:00Z``. A
replica whose clock is behind the boundary by a few seconds computes the previous slot,
then sends the new one a few seconds later and finds it already claimed; one that is
ahead sends a few seconds early. Either way, each slot is sent once.

This module is pure: no database, no I/O, no module-level mutable state.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable
from datetime import datetime, timedelta, timezone, tzinfo
from typing import Any, cast
from zoneinfo import ZoneInfo

from celery.schedules import BaseSchedule, crontab, schedstate, schedule, solar

__all__ = [
    "MAX_WAIT",
    "Once",
    "crontab_slot",
    "due_state",
    "format_slot",
    "interval_slot",
    "is_time_slot",
    "next_interval_boundary",
    "next_occurrence",
    "parse_slot",
    "schedule_zone",
    "slot_for",
    "slots_since",
    "solar_slot",
]

#: Longest advised sleep, in seconds, before checking an entry again (Celery's default
#: ``beat_max_loop_interval``).
MAX_WAIT = 300.0

#: The form of every slot beat computes (``format_slot``). Fixed width, so two such slots
#: compare as text in time order; the same pattern works in Python and in PostgreSQL.
SLOT_PATTERN = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z$"
_SLOT_RE = re.compile(SLOT_PATTERN)
_SLOT_FORMAT = "%Y-%m-%dT%H:%M:%SZ"

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_CRONTAB_WINDOWS = tuple(
    timedelta(minutes=m) for m in (2, 2 * 60, 2 * 1440, 40 * 1440, 400 * 1440, 5 * 366 * 1440)
)
_SOLAR_WINDOWS = (timedelta(days=2), timedelta(days=40), timedelta(days=400))
_SOLAR_SEARCH_DAYS = 366

#: First occurrence strictly after a point in time, or None if there is none.
_Step = Callable[[datetime], "datetime | None"]
_Bounds = tuple["datetime | None", "datetime | None"]


@functools.lru_cache(maxsize=1024)  # a beat tick formats one boundary for many entries
def format_slot(dt: datetime) -> str:
    """Return the slot id of an aware datetime: UTC, second precision, ``Z`` suffix."""
    utc = _aware(dt).astimezone(timezone.utc)
    return utc.replace(microsecond=0, tzinfo=None).isoformat() + "Z"


def is_time_slot(slot: str | None) -> bool:
    """Whether ``slot`` is a time slot as beat sends them (``2026-11-29T18:05:00Z``)."""
    return slot is not None and _SLOT_RE.fullmatch(slot) is not None


@functools.lru_cache(maxsize=1024)  # a tick parses one slot for many entries
def parse_slot(slot: str) -> datetime:
    """The aware UTC datetime of a time slot (``ValueError`` for any other string).

    A slot in the canonical form is read field by field (about 3 times faster than
    ``strptime``: the dashboard reads thousands per page); any other string goes to
    ``strptime`` as before, which accepts or refuses it as it always did."""
    if is_time_slot(slot):
        return datetime(
            int(slot[0:4]),
            int(slot[5:7]),
            int(slot[8:10]),
            int(slot[11:13]),
            int(slot[14:16]),
            int(slot[17:19]),
            tzinfo=timezone.utc,
        )
    return datetime.strptime(slot, _SLOT_FORMAT).replace(tzinfo=timezone.utc)


def interval_slot(now: datetime, every: timedelta) -> datetime:
    """Return the latest epoch-aligned boundary of ``every`` at or before ``now`` (UTC)."""
    if every < timedelta(seconds=1):
        raise ValueError(f"interval schedules need run_every >= 1 second, got {every!r}")
    return _EPOCH + ((_aware(now) - _EPOCH) // every) * every


def next_interval_boundary(now: datetime, every: timedelta) -> datetime:
    """Return the first epoch-aligned boundary of ``every`` strictly after ``now``."""
    return interval_slot(now, every) + every


def crontab_slot(sched: crontab, now: datetime) -> datetime | None:
    """Return the latest occurrence of ``sched`` at or before ``now`` (UTC), or None.

    None means no occurrence in the last five years.
    """
    return _crontab_bounds(sched, now)[0]


def solar_slot(sched: solar, now: datetime) -> datetime | None:
    """Return the latest event of ``sched`` at or before ``now``, rounded to the minute.

    None means no such event in the last 400 days (polar regions).
    """
    return _solar_bounds(sched, now)[0]


def slot_for(sched: BaseSchedule, now: datetime, *, align_intervals: bool = True) -> str | None:
    """Return the slot id of the occurrence of ``sched`` current at ``now``, or None.

    None for unaligned intervals (the caller falls back to a per-process slot), for
    schedule types this module does not know, and when no occurrence was found.
    """
    bounds = _bounds(sched, now, align_intervals)
    if bounds is None or bounds[0] is None:
        return None
    return format_slot(bounds[0])


def next_occurrence(
    sched: BaseSchedule, after: datetime, *, align_intervals: bool = True
) -> datetime | None:
    """The first occurrence of ``sched`` strictly after ``after`` (None: none, or a
    schedule this module cannot compute slots for)."""
    bounds = _bounds(sched, after, align_intervals)
    return None if bounds is None else bounds[1]


def schedule_zone(sched: BaseSchedule) -> tzinfo:
    """The zone a crontab's wall times are read in (the app's ``timezone``); UTC else."""
    return _zone(sched) if isinstance(sched, crontab) else timezone.utc


def slots_since(
    sched: BaseSchedule, now: datetime, after: str, *, limit: int, align_intervals: bool = True
) -> tuple[list[str], bool]:
    """Return the newest ``limit`` slots in ``(after, now]``, oldest first, and whether
    older ones in that range were left out. Walks back one occurrence at a time.
    """
    found: list[str] = []
    point = now
    while True:
        slot = slot_for(sched, point, align_intervals=align_intervals)
        if slot is None or slot <= after:
            return found[::-1], False
        if len(found) == limit:
            return found[::-1], True
        found.append(slot)
        point = parse_slot(slot) - timedelta(seconds=1)


def due_state(
    sched: BaseSchedule,
    now: datetime,
    last_slot: str | None,
    *,
    align_intervals: bool = True,
    max_wait: float = MAX_WAIT,
) -> tuple[str | None, float]:
    """Return ``(slot to send now or None, seconds until the next check)``.

    The current slot is due when it is newer than ``last_slot`` (slot ids sort in time
    order); ``last_slot=None`` means nothing was sent yet, so the current slot is due.
    The wait runs to the next occurrence, within ``[0, max_wait]``; it is ``max_wait``
    when this module cannot compute slots for ``sched`` (use ``sched.is_due`` instead).
    """
    bounds = _bounds(sched, now, align_intervals)
    if bounds is None:
        return None, max_wait
    current, upcoming = bounds
    wait = max_wait if upcoming is None else (upcoming - now).total_seconds()
    wait = min(max(wait, 0.0), max_wait)
    slot = None if current is None else format_slot(current)
    if slot is None or (last_slot is not None and slot <= last_slot):
        return None, wait
    return slot, wait


class Once(BaseSchedule):
    """One occurrence, at ``at`` (django-celery-beat's clocked schedule): its slot is that
    time, so it is sent once whichever replica leads then."""

    def __init__(self, at: datetime, app: Any = None) -> None:
        super().__init__(app=app)
        self.at = _aware(at).astimezone(timezone.utc)

    def __repr__(self) -> str:
        return f"<once at {format_slot(self.at)}>"

    def is_due(self, last_run_at: datetime) -> schedstate:
        """Celery's question; beat's own answer comes from the slot (``due_state``)."""
        remaining = (self.at - datetime.now(timezone.utc)).total_seconds()
        return schedstate(False, max(remaining, 1.0))


def _aware(dt: datetime) -> datetime:
    """Return ``dt`` if it carries a timezone; naive datetimes are ambiguous across hosts."""
    if dt.tzinfo is None or dt.utcoffset() is None:
        raise ValueError(f"slots need timezone-aware datetimes, got naive {dt.isoformat()}")
    return dt


def _bounds(sched: BaseSchedule, now: datetime, align_intervals: bool) -> _Bounds | None:
    """Return (latest occurrence <= now, first occurrence > now), None if unsupported."""
    if isinstance(sched, Once):
        return (sched.at, None) if sched.at <= now else (None, sched.at)
    if isinstance(sched, crontab):
        return _crontab_bounds(sched, now)
    if isinstance(sched, solar):
        return _solar_bounds(sched, now)
    if isinstance(sched, schedule) and align_intervals:
        every = timedelta(seconds=sched.seconds)
        current = interval_slot(now, every)
        return current, current + every
    return None


def _search(step: _Step, now: datetime, starts: list[datetime]) -> _Bounds:
    """Walk ``step`` from each start in turn until one reaches an occurrence <= now."""
    upcoming = None
    for start in starts:
        latest, upcoming = None, step(start)
        while upcoming is not None and upcoming <= now:
            latest, upcoming = upcoming, step(upcoming)
        if latest is not None:
            return latest, upcoming
    return None, upcoming


def _crontab_bounds(sched: crontab, now: datetime) -> _Bounds:
    """Bracket ``now`` between crontab occurrences, searching ever further back."""
    zone = _zone(sched)
    now = _aware(now).astimezone(timezone.utc)
    # A start inside a repeated (fall-back) hour is read as its first occurrence: Celery's
    # chain drops the fold, so stepping from the second reading would jump back in time.
    starts = [(now - w).astimezone(zone).replace(fold=0) for w in _CRONTAB_WINDOWS]
    return _search(lambda after: _crontab_next(sched, after), now, starts)


def _crontab_next(sched: crontab, after: datetime) -> datetime:
    """Return the occurrence Celery fires next when its last run was at ``after`` (UTC).

    The same on every Celery version: ``after`` is handed over in the schedule's timezone
    (before 5.7 Celery matched the fields in whatever timezone the datetime came in), to
    a view of the schedule whose clock reads ``after`` (before 5.7 the minutes left in an
    hour counted only on the day of the clock reading), and the result is computed from
    ``after`` itself (before 5.7 it came back in the host's zone with ``enable_utc=False``).
    """
    local = after.astimezone(_zone(sched))
    _, delta, _ = _clock_reading(sched, local).remaining_delta(local)
    occurrence: datetime = (local + delta).astimezone(timezone.utc)
    if occurrence <= after:
        raise RuntimeError(f"{sched!r} did not advance past {after.isoformat()}")
    return occurrence


def _clock_reading(sched: crontab, now: datetime) -> crontab:
    """A shallow view of ``sched`` whose clock (``nowfun``) always reads ``now``."""
    view: Any = object.__new__(type(sched))
    view.__dict__.update(vars(sched))
    view.nowfun = lambda: now
    return cast(crontab, view)


def _zone(sched: BaseSchedule) -> tzinfo:
    """Return the timezone Celery evaluates ``sched`` in (the app's ``timezone``)."""
    zone: str | tzinfo = sched.tz
    return ZoneInfo(zone) if isinstance(zone, str) else zone


def _solar_bounds(sched: solar, now: datetime) -> _Bounds:
    """Bracket ``now`` between rounded solar events, searching ever further back."""
    now = _aware(now).astimezone(timezone.utc)
    find = _solar_finder(sched)

    def step(after: datetime) -> datetime | None:
        probe = after - timedelta(minutes=1)
        while (raw := find(probe)) is not None:
            # Recompute from a start that depends only on the event's hour, far from the
            # rounding edge at :30, so every replica rounds the same float.
            again = find(interval_slot(raw, timedelta(hours=1)) - timedelta(hours=1))
            precise = again if again and abs(again - raw) < timedelta(minutes=1) else raw
            event = interval_slot(precise + timedelta(seconds=30), timedelta(minutes=1))
            if event > after:
                return event
            probe = raw + timedelta(minutes=1)
        return None

    return _search(step, now, [now - w for w in _SOLAR_WINDOWS])


def _solar_finder(sched: solar) -> Callable[[datetime], datetime | None]:
    """Return a function giving the first raw event of ``sched`` after a UTC time."""
    ephem = _ephem()
    spec: Any = sched  # Celery sets method/use_center; the stubs do not declare them
    cal = spec.cal.copy()  # never move the schedule's own observer
    method = getattr(cal, spec.method)
    options = {"use_center": True} if spec.use_center else {}

    def find(after: datetime) -> datetime | None:
        start = ephem.Date(after.astimezone(timezone.utc).replace(tzinfo=None))
        for _ in range(_SOLAR_SEARCH_DAYS):  # the event may not happen every day
            try:
                event = method(ephem.Sun(), start=start, **options)
            except ephem.CircumpolarError:
                start = cal.next_antitransit(ephem.Sun(), start=start)
                continue
            found: datetime = event.datetime().replace(tzinfo=timezone.utc)
            return found
        return None

    return find


def _ephem() -> Any:
    """Import ephem, which solar schedules need, with an error naming the fix."""
    try:
        return importlib.import_module("ephem")
    except ImportError as exc:
        raise ImportError("solar schedules need the ephem package: pip install ephem") from exc
