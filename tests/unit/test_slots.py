"""Slot computation: the identity of a beat occurrence, checked against Celery's own beat."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import celery
import pytest
from celery import Celery
from celery.schedules import BaseSchedule, crontab, schedule, solar

from celery_pglock._slots import (
    MAX_WAIT,
    crontab_slot,
    due_state,
    format_slot,
    interval_slot,
    next_interval_boundary,
    slot_for,
    solar_slot,
)

UTC = timezone.utc
BERLIN = ZoneInfo("Europe/Berlin")


class Clock:
    """A fake clock for Celery schedules (``nowfun``)."""

    def __init__(self) -> None:
        self.now = datetime(2025, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


def utc(text: str) -> datetime:
    """Return an aware UTC datetime from ``YYYY-MM-DD[THH:MM[:SS]]``."""
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def make_app() -> Celery:
    """Return an isolated Celery app in Europe/Berlin."""
    app = Celery(set_as_current=False)
    app.conf.update(timezone="Europe/Berlin")
    return app


def cron(spec: str, clock: Clock | None = None) -> crontab:
    """Return a Berlin crontab from a five-field spec."""
    minute, hour, dom, month, dow = spec.split()
    return crontab(minute, hour, dow, dom, month, app=make_app(), nowfun=clock)


def celery_fires(
    sched: BaseSchedule, clock: Clock, start: datetime, end: datetime, max_wait: float = MAX_WAIT
) -> list[datetime]:
    """Return the times stock Celery beat fires ``sched`` in [start, end), stepped as beat does.

    Beat reads its clock and records ``last_run_at`` in the app's timezone (``app.now()``);
    Celery before 5.7 evaluates a crontab in the timezone of the datetimes it is given.
    """
    clock.now = last_run_at = start.astimezone(BERLIN)
    fired: list[datetime] = []
    while clock.now < end:
        is_due, wait = sched.is_due(last_run_at)
        if is_due:
            fired.append(clock.now)
            last_run_at = clock.now
        step = timedelta(seconds=min(wait, max_wait))
        clock.now = (clock.now.astimezone(UTC) + step).astimezone(BERLIN)  # elapsed, not wall
    return fired


#: Stock beat's own misfires on older Celery: (spec, fired, nominal time or None for a
#: send the nominal sequence does not have), and the first version that fires nominally.
#: Before 5.5.2 the first crontab occurrence on or after a spring-forward was computed
#: with the old UTC offset; before 5.7 solar times were subtracted as wall-clock times,
#: an hour off on the day of a change. Slots are the nominal times on every version.
STOCK_MISFIRES: list[tuple[str, str, str | None, tuple[int, int, int]]] = [
    ("30 2 * * *", "2025-03-30T01:00:00Z", "2025-03-30T01:30:00Z", (5, 5, 2)),
    ("15 1-3 * * *", "2025-03-30T01:00:00Z", None, (5, 5, 2)),
    ("0 9 * * mon", "2025-03-31T08:00:00Z", "2025-03-31T07:00:00Z", (5, 5, 2)),
    ("0 0 1 * *", "2025-03-31T23:00:00Z", "2025-03-31T22:00:00Z", (5, 5, 2)),
    ("sunrise", "2025-03-30T05:45:00Z", "2025-03-30T04:45:00Z", (5, 7, 0)),
]


def nominal(spec: str, fired: list[str], start: datetime, end: datetime) -> list[str]:
    """Return ``fired`` with the misfires of the installed Celery in [start, end) replaced
    by nominal times. Each one listed for this version must be there: a changed Celery
    fails the test.
    """
    fixed = list(fired)
    for misfire_spec, wrong, right, fixed_in in STOCK_MISFIRES:
        if misfire_spec != spec or tuple(celery.VERSION[:3]) >= fixed_in:
            continue
        if not format_slot(start) <= wrong < format_slot(end):
            continue
        assert wrong in fixed, f"Celery {celery.__version__} no longer fires {spec} at {wrong}"
        fixed.remove(wrong)
        if right is not None and right not in fixed:
            fixed.append(right)
    return sorted(fixed)


def our_sends(
    sched: BaseSchedule, start: datetime, end: datetime, max_wait: float = MAX_WAIT
) -> list[str]:
    """Return the slots a due_state scheduler started at ``start`` sends before ``end``."""
    now, last, sent = start, slot_for(sched, start), []
    while now < end:
        slot, wait = due_state(sched, now, last, max_wait=max_wait)
        if slot is not None:
            sent.append(slot)
            last = slot
        now += timedelta(seconds=wait)
    return sent


def test_format_slot_is_utc_second_precision_with_z() -> None:
    """An aware datetime formats as its UTC time, microseconds dropped, with a Z."""
    expected = "2026-11-29T18:05:00Z"
    assert expected == format_slot(datetime(2026, 11, 29, 19, 5, 0, 999999, BERLIN))


def test_format_slot_rejects_naive_datetimes() -> None:
    """A naive datetime is refused with an error saying it must be aware."""
    with pytest.raises(ValueError, match="timezone-aware"):
        format_slot(datetime(2026, 11, 29, 18, 5))


@pytest.mark.parametrize(
    ("every", "expected"),
    [
        (timedelta(seconds=1), utc("2026-11-29T18:05:07")),
        (timedelta(seconds=10), utc("2026-11-29T18:05")),
        (timedelta(minutes=1), utc("2026-11-29T18:05")),
        (timedelta(hours=1), utc("2026-11-29T18:00")),
        (timedelta(days=1), utc("2026-11-29")),
    ],
)
def test_interval_slot_is_latest_epoch_boundary(every: timedelta, expected: datetime) -> None:
    """An interval slot is the latest multiple of the interval since the epoch."""
    assert expected == interval_slot(datetime(2026, 11, 29, 18, 5, 7, 400000, UTC), every)


def test_interval_slot_is_independent_of_input_timezone() -> None:
    """The same instant gives the same boundary whatever its timezone."""
    every = timedelta(hours=1)
    assert interval_slot(utc("2026-11-29T18:30"), every) == interval_slot(
        datetime(2026, 11, 29, 19, 30, tzinfo=BERLIN), every
    )


def test_interval_slot_rejects_sub_second_intervals() -> None:
    """Intervals shorter than a second are refused with a clear error."""
    with pytest.raises(ValueError, match=">= 1 second"):
        interval_slot(utc("2026-01-01"), timedelta(milliseconds=500))


def test_next_interval_boundary_is_strictly_after_now() -> None:
    """At a boundary, the next boundary is one interval later."""
    assert utc("2026-01-01T00:10") == next_interval_boundary(
        utc("2026-01-01"), timedelta(minutes=10)
    )


def test_interval_schedulers_started_83_minutes_apart_send_the_same_slots() -> None:
    """Two schedulers started 83 minutes apart send identical slots after both run."""
    every = schedule(timedelta(minutes=10), app=make_app())
    first_start = datetime(2026, 3, 1, 9, 1, 13, 370000, UTC)
    second_start = first_start + timedelta(minutes=83, seconds=4.9)
    end = first_start + timedelta(hours=6)
    first = our_sends(every, first_start, end)
    assert [s for s in first if s > format_slot(second_start)] == our_sends(
        every, second_start, end
    )


def test_clock_skew_of_seconds_gives_the_same_slot() -> None:
    """Replicas reading 18:05:00.2 and 18:05:02.9 compute the same slot."""
    sched = cron("*/5 * * * *")
    assert slot_for(sched, datetime(2026, 11, 29, 18, 5, 0, 200000, UTC)) == slot_for(
        sched, datetime(2026, 11, 29, 18, 5, 2, 900000, UTC)
    )


def test_crontab_slot_is_latest_nominal_time_in_app_timezone() -> None:
    """A crontab slot is the latest nominal occurrence, in the app timezone, as UTC."""
    assert utc("2026-07-01T16:00") == crontab_slot(cron("*/15 * * * *"), utc("2026-07-01T16:14:59"))


@pytest.mark.parametrize(
    ("spec", "start", "end"),
    [
        ("*/15 * * * *", utc("2025-03-29T22:00"), utc("2025-03-30T06:00")),
        ("*/15 * * * *", utc("2025-10-25T22:00"), utc("2025-10-26T06:00")),
        ("30 2 * * *", utc("2025-03-27"), utc("2025-04-02")),
        ("30 2 * * *", utc("2025-10-23"), utc("2025-10-29")),
        ("0 * * * *", utc("2025-03-29T20:00"), utc("2025-03-30T06:00")),
        ("0 * * * *", utc("2025-10-25T20:00"), utc("2025-10-26T06:00")),
        ("15 1-3 * * *", utc("2025-03-28"), utc("2025-04-01")),
        ("15 1-3 * * *", utc("2025-10-24"), utc("2025-10-28")),
        ("0 9 * * mon", utc("2025-03-01"), utc("2025-05-01")),
        ("0 0 1 * *", utc("2025-01-15"), utc("2026-02-15")),
        ("0 12 29 2 *", utc("2023-01-01"), utc("2033-01-01")),
    ],
)
def test_crontab_slots_are_the_times_celery_beat_fires(
    spec: str, start: datetime, end: datetime
) -> None:
    """A slot scheduler sends exactly the nominal times stock Celery beat fires."""
    clock = Clock()
    sched = cron(spec, clock)
    max_wait = MAX_WAIT if end - start <= timedelta(days=7) else math.inf  # as beat; or quick
    fired = [format_slot(t) for t in celery_fires(sched, clock, start, end, max_wait)]
    assert nominal(spec, fired, start, end) == our_sends(sched, start, end, max_wait)


def test_spring_forward_fires_missing_time_one_hour_later() -> None:
    """On 30 March 2025 the missing 02:30 Berlin fires at 03:30 CEST (01:30Z)."""
    expected = "2025-03-30T01:30:00Z"
    assert expected == slot_for(cron("30 2 * * *"), utc("2025-03-30T01:31"))


def test_fall_back_fires_repeated_hour_once() -> None:
    """On 26 October 2025 an hourly crontab fires 02:00 Berlin once, not twice."""
    sends = our_sends(cron("0 * * * *"), utc("2025-10-25T23:30"), utc("2025-10-26T03:30"))
    expected = ["2025-10-26T00:00:00Z", "2025-10-26T02:00:00Z", "2025-10-26T03:00:00Z"]
    assert expected == sends


def test_replica_started_in_repeated_hour_does_not_resend() -> None:
    """A replica starting in the second 02:xx hour finds the last slot already sent."""
    expected = (None, 300.0)
    assert expected == due_state(
        cron("*/15 * * * *"), utc("2025-10-26T01:45"), "2025-10-26T00:45:00Z"
    )


@pytest.mark.parametrize("spec", ["*/15 * * * *", "7 */3 * * *"])
def test_crontab_schedulers_started_apart_send_the_same_slots(spec: str) -> None:
    """Two crontab schedulers started at different times send identical slots."""
    sched, end = cron(spec), utc("2025-10-27")
    first = our_sends(sched, utc("2025-10-25T21:04:01"), end)
    second_start = utc("2025-10-26T01:27:09")  # inside the repeated hour
    assert [s for s in first if s > format_slot(second_start)] == our_sends(
        sched, second_start, end
    )


def test_crontab_without_occurrence_in_five_years_has_no_slot() -> None:
    """A crontab whose last occurrence is over five years back has no slot."""
    monday_leap_day = cron("0 0 29 2 mon")  # 2016, then 2044
    assert None is crontab_slot(monday_leap_day, utc("2030-01-01"))


@pytest.fixture
def clock() -> Clock:
    """Return a fake clock."""
    return Clock()


@pytest.fixture
def berlin_sunrise(clock: Clock) -> solar:
    """Return a sunrise schedule for Berlin on the fake clock, skipping when ephem is missing."""
    pytest.importorskip("ephem")
    return solar("sunrise", 52.52, 13.40, app=make_app(), nowfun=clock)


def test_solar_slot_is_latest_event_rounded_to_minute(berlin_sunrise: solar) -> None:
    """A solar slot is the latest event at or before now, to the minute (02:49:37 -> 02:50)."""
    assert utc("2025-06-01T02:50") == solar_slot(berlin_sunrise, utc("2025-06-01T12:00"))


def test_solar_slot_is_the_same_from_any_point_in_time(berlin_sunrise: solar) -> None:
    """Every reading between two sunrises gives the same slot."""
    readings = [utc("2025-06-01T02:50") + timedelta(minutes=37 * i) for i in range(38)]
    assert {"2025-06-01T02:50:00Z"} == {slot_for(berlin_sunrise, now) for now in readings}


def test_solar_event_on_the_rounding_edge_is_sent_once() -> None:
    """A sunrise at 02:49:30.00 (ephem jitters across :30 by start) is sent once."""
    pytest.importorskip("ephem")
    edge = solar("sunrise", 52.52, 13.403871648498853, app=make_app())  # bisected longitude
    expected = ["2025-06-01T02:50:00Z", "2025-06-02T02:49:00Z"]
    assert expected == our_sends(edge, utc("2025-05-31T12:00"), utc("2025-06-02T12:00"))


def test_solar_slots_are_celery_event_times_rounded(berlin_sunrise: solar, clock: Clock) -> None:
    """Slots are the events stock Celery fires, rounded to the minute."""
    start, end = utc("2025-03-25"), utc("2025-04-05")
    rounded = [
        format_slot((t + timedelta(seconds=30)).replace(second=0, microsecond=0))
        for t in celery_fires(berlin_sunrise, clock, start, end, math.inf)
    ]
    assert nominal("sunrise", rounded, start, end) == our_sends(
        berlin_sunrise, start, end, math.inf
    )


def test_due_state_sends_current_slot_when_nothing_was_sent() -> None:
    """With no slot sent yet, the current slot is due."""
    expected = ("2026-01-01T10:00:00Z", 60.0)
    assert expected == due_state(cron("0 * * * *"), utc("2026-01-01T10:59"), None)


def test_due_state_is_not_due_for_the_slot_already_sent() -> None:
    """The slot already sent is not due again; the wait runs to the next boundary."""
    every = schedule(timedelta(seconds=30), app=make_app())
    expected = (None, 20.0)
    assert expected == due_state(every, utc("2026-01-01T00:00:10"), "2026-01-01T00:00:00Z")


def test_due_state_sends_a_newer_slot() -> None:
    """A slot newer than the last one sent is due."""
    every = schedule(timedelta(seconds=30), app=make_app())
    expected = ("2026-01-01T00:00:30Z", 30.0)
    assert expected == due_state(every, utc("2026-01-01T00:00:30"), "2026-01-01T00:00:00Z")


def test_due_state_ignores_slots_older_than_the_last_sent() -> None:
    """A clock that went back does not resend an older slot."""
    every = schedule(timedelta(seconds=30), app=make_app())
    expected = (None, 30.0)
    assert expected == due_state(every, utc("2026-01-01"), "2026-01-01T00:00:30Z")


def test_due_state_caps_the_wait() -> None:
    """The advised wait never exceeds max_wait."""
    expected = (None, 300.0)
    assert expected == due_state(cron("0 0 1 * *"), utc("2026-01-02"), "2026-01-01T00:00:00Z")


def test_unaligned_interval_has_no_slot() -> None:
    """Without alignment an interval gets no slot, so the caller uses a per-process one."""
    every = schedule(timedelta(minutes=5), app=make_app())
    expected = (None, 300.0)
    assert expected == due_state(every, utc("2026-01-01"), None, align_intervals=False)


def test_unknown_schedule_type_has_no_slot() -> None:
    """A schedule type this module does not know gets no slot."""
    assert None is slot_for(BaseSchedule(app=make_app()), utc("2026-01-01"))
