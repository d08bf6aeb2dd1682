"""A stored schedule entry's parts, checked before anything is stored (``_entry_specs``),
and the one-off schedule's slot: each bad input is a clear error naming its field."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery
from celery.schedules import crontab, schedule, solar

from celery_pglock import _entry_specs as specs
from celery_pglock import _slots as slots
from celery_pglock.errors import ConfigurationError

APP = Celery("specs", set_as_current=False)
APP.conf.timezone = "Europe/Berlin"


@pytest.mark.parametrize(
    ("given", "seconds"),
    [(30, 30.0), ("30s", 30.0), ("5m", 300.0), ("2h", 7200.0), ("1d", 86400.0), ("1.5", 1.5)],
)
def test_an_interval_is_read_in_seconds_or_with_a_unit(given: Any, seconds: float) -> None:
    assert {"every": seconds} == specs.schedule_spec(every=given)


@pytest.mark.parametrize(
    ("given", "field"),
    [
        ({"every": 0}, "every"),
        ({"every": 0.5}, "at least 1 s"),
        ({"every": "500ms"}, "every"),
        ({"every": "-5s"}, "every"),
        ({"every": "soon"}, "every"),
        ({"every": True}, "every"),
        ({"cron": "*/5 * * *"}, "cron"),
        ({"cron": "61 * * * *"}, "cron"),
        ({"cron": "* * * * *", "tz": "Mars/Olympus"}, "tz"),
        ({"every": 30, "tz": "UTC"}, "tz"),
        ({"at": "2026-12-24T09:00:00"}, "at"),
        ({"at": "christmas"}, "at"),
        ({"every": 30, "cron": "* * * * *"}, "exactly one schedule"),
        ({}, "exactly one schedule"),
    ],
)
def test_a_bad_schedule_is_refused_naming_the_field(given: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigurationError, match=field):
        specs.schedule_spec(**given)


def test_a_cron_schedule_keeps_its_timezone_and_is_read_there() -> None:
    stored = specs.schedule_spec(cron="0 8 * * mon", tz="America/New_York")

    made = specs.celery_schedule(stored, APP)

    assert isinstance(made, crontab)
    assert "America/New_York" == str(slots.schedule_zone(made))
    monday = datetime(2026, 12, 7, 14, 0, tzinfo=timezone.utc)  # 09:00 in New York
    assert "2026-12-07T13:00:00Z" == slots.slot_for(made, monday)


def test_every_stored_schedule_becomes_the_one_celery_knows() -> None:
    assert isinstance(specs.celery_schedule({"every": 30.0}, APP), schedule)
    assert isinstance(
        specs.celery_schedule({"solar": "sunrise", "lat": 48.0, "lon": 2.0}, APP), solar
    )
    assert "Europe/Berlin" == str(
        slots.schedule_zone(specs.celery_schedule({"cron": "0 8 * * *"}, APP))
    )


def test_a_one_off_has_one_slot_at_its_time_and_none_before() -> None:
    at = datetime(2026, 12, 24, 9, 0, tzinfo=timezone.utc)
    once = specs.celery_schedule(specs.schedule_spec(at="2026-12-24T10:00:00+01:00"), APP)

    assert (None, 60.0) == slots.due_state(once, at - timedelta(minutes=5), None, max_wait=60)
    assert ("2026-12-24T09:00:00Z", 60.0) == slots.due_state(once, at, None, max_wait=60)
    later = at + timedelta(days=3)
    assert (None, 60.0) == slots.due_state(once, later, "2026-12-24T09:00:00Z", max_wait=60)


def test_a_one_off_given_now_must_lie_ahead() -> None:
    past = (datetime.now(timezone.utc) - timedelta(minutes=1)).isoformat()
    with pytest.raises(ConfigurationError, match=r"at: .* a time ahead"):
        specs.ahead("at", past)


@pytest.mark.parametrize(
    ("args", "kwargs", "field"),
    [
        ("[1, 2", None, "args"),
        ({"a": 1}, None, "args"),
        (None, "[1]", "kwargs"),
        (None, {"when": datetime.now()}, "kwargs"),
        (["x" * specs.MAX_ARGUMENTS_BYTES], None, "at most"),
    ],
)
def test_arguments_that_are_not_json_or_too_large_are_refused(
    args: Any, kwargs: Any, field: str
) -> None:
    with pytest.raises(ConfigurationError, match=field):
        specs.arguments(args, kwargs)


def test_arguments_given_as_json_text_or_a_tuple_are_read() -> None:
    assert ([1, "a"], {"to": "ops"}) == specs.arguments('[1, "a"]', '{"to": "ops"}')
    assert ([1, "a"], {}) == specs.arguments((1, "a"), None)  # as beat_schedule writes them


@pytest.mark.parametrize(
    ("given", "field"),
    [
        ({"priority": 300}, "priority"),
        ({"priority": "high"}, "priority"),
        ({"expires": 0}, "expires"),
        ({"queue": ""}, "queue"),
        ({"headers": "[1]"}, "headers"),
        ({"retry": True}, "unknown send option"),
    ],
)
def test_bad_send_options_are_refused(given: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigurationError, match=field):
        specs.send_options(given)


def test_bad_library_options_are_refused_with_the_setting_s_own_words() -> None:
    with pytest.raises(ConfigurationError, match="pglock_beat_catch_up must be one of"):
        specs.pglock_options({"catch_up": "some"}, "e")
    with pytest.raises(ConfigurationError, match="pglock_overdue_after"):
        specs.pglock_options({"overdue_after": -1}, "e")
    with pytest.raises(ConfigurationError, match="unknown option"):
        specs.pglock_options({"overlap": "skip"}, "e")
