"""A schedule entry stored in PostgreSQL, as a project gives it and as beat sends it.

``spec`` checks what an entry is made of before anything is stored (a clear error naming
the field, ``ConfigurationError``) and gives the row's values; ``celery_schedule`` turns a
stored ``schedule`` back into the object Celery and the slot computation know. The
schedule is one of:

- ``{"every": seconds}`` (an interval, aligned to epoch boundaries like every interval);
- ``{"cron": "m h dom mon dow", "tz": zone}`` (``tz`` optional: the app's timezone);
- ``{"solar": event, "lat": degrees, "lon": degrees}``;
- ``{"at": "2026-12-24T09:00:00+00:00"}`` (once, at that time: django-celery-beat's clocked).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone, tzinfo
from typing import Any, cast
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from celery.schedules import BaseSchedule, crontab, schedule, solar

from celery_pglock._slots import Once
from celery_pglock._values import catch_up_option, overdue_option
from celery_pglock.errors import ConfigurationError

MAX_ARGUMENTS_BYTES = 65_536  # args and kwargs together, as JSON
MAX_NAME_LENGTH = 200
SEND_OPTIONS = ("queue", "exchange", "routing_key", "priority", "expires", "headers")
# The library's per-entry options and the ``options`` keys beat reads them from.
PGLOCK_OPTIONS = {
    "catch_up": "pglock_catch_up",
    "catch_up_limit": "pglock_catch_up_limit",
    "overdue_after": "pglock_overdue_after",
}
_EVERY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")
_UNIT_SECONDS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def every_seconds(value: Any) -> float:
    """An interval given as seconds or as ``30s``, ``5m``, ``2h``, ``1d``: seconds > 0."""
    if isinstance(value, bool):
        raise _bad("every", value, "a number of seconds > 0, or 30s, 5m, 2h, 1d")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        found = _EVERY.match(str(value))
        if found is None:
            raise _bad("every", value, "a number of seconds > 0, or 30s, 5m, 2h, 1d")
        seconds = float(found.group(1)) * _UNIT_SECONDS[found.group(2) or "s"]
    if not seconds >= 1:  # a slot is a whole second: two in one second would be one slot
        raise _bad("every", value, "an interval of at least 1 s")
    return seconds


def zone(name: Any) -> tzinfo:
    """An IANA timezone by name (``Europe/Paris``)."""
    try:
        return ZoneInfo(str(name))
    except (ZoneInfoNotFoundError, ValueError):
        raise _bad("tz", name, "an IANA timezone such as Europe/Paris or UTC") from None


def moment(field: str, value: Any) -> datetime:
    """A time with its UTC offset (ISO 8601), in UTC: a time without one is refused."""
    if isinstance(value, datetime):
        found = value
    else:
        try:
            found = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
        except ValueError:
            raise _bad(field, value, "an ISO 8601 time such as 2026-12-24T09:00:00Z") from None
    if found.tzinfo is None:
        raise _bad(field, value, "a time with its UTC offset (2026-12-24T09:00:00Z)")
    return found.astimezone(timezone.utc)


def ahead(field: str, value: Any) -> datetime:
    """A time given for a one-off: it must lie ahead (a past one would never be sent)."""
    found = moment(field, value)
    if found <= datetime.now(timezone.utc):
        raise _bad(field, value, "a time ahead: a one-off in the past is never sent")
    return found


def schedule_spec(
    *,
    every: Any = None,
    cron: Any = None,
    tz: Any = None,
    at: Any = None,
    solar_event: Any = None,
    lat: Any = None,
    lon: Any = None,
) -> dict[str, Any]:
    """The stored form of exactly one schedule, checked."""
    given = [name for name, v in (("every", every), ("cron", cron), ("at", at)) if v is not None]
    given += ["solar"] if solar_event is not None else []
    if len(given) != 1:
        raise ConfigurationError(
            "an entry has exactly one schedule: every (30s, 5m…), cron "
            f"('*/5 * * * *'), at (a time) or solar; got {given or 'none'}"
        )
    if tz is not None and cron is None:
        raise ConfigurationError("tz: a timezone goes with a cron schedule only")
    if every is not None:
        return {"every": every_seconds(every)}
    if cron is not None:
        found: dict[str, Any] = {"cron": _cron_text(cron)}
        if tz is not None:
            zone(tz)
            found["tz"] = str(tz)
        return found
    if at is not None:
        return {"at": moment("at", at).isoformat()}
    return _solar_spec(solar_event, lat, lon)


def celery_schedule(stored: Mapping[str, Any], app: Any) -> BaseSchedule:
    """The Celery schedule of a stored ``schedule``."""
    if "every" in stored:
        return schedule(timedelta(seconds=float(stored["every"])), app=app)
    if "cron" in stored:
        fields = stored["cron"].split()
        minute, hour, day_of_month, month_of_year, day_of_week = fields
        made = crontab(minute, hour, day_of_week, day_of_month, month_of_year, app=app)
        if stored.get("tz"):
            made = ZonedCrontab.of(made, zone(stored["tz"]))
        return made
    if "at" in stored:
        return Once(moment("at", stored["at"]), app=app)
    event: Any = stored["solar"]
    return solar(event, float(stored["lat"]), float(stored["lon"]), app=app)


class ZonedCrontab(crontab):
    """A crontab read in a timezone of its own, not the app's."""

    _zone: tzinfo

    @classmethod
    def of(cls, made: crontab, where: tzinfo) -> ZonedCrontab:
        zoned: ZonedCrontab = object.__new__(cls)
        zoned.__dict__.update(vars(made))
        zoned._zone = where
        return zoned

    @property
    def tz(self) -> tzinfo:  # type: ignore[override] # Celery's own is the app's zone too
        return self._zone


def arguments(args: Any, kwargs: Any) -> tuple[list[Any], dict[str, Any]]:
    """The task's arguments: a JSON list and a JSON object, at most ``MAX_ARGUMENTS_BYTES``."""
    if isinstance(args, tuple):  # as beat_schedule entries and Python callers write them
        args = list(args)
    args = _json("args", [] if args is None else args)
    kwargs = _json("kwargs", {} if kwargs is None else kwargs)
    if not isinstance(args, list):
        raise _bad("args", args, 'a JSON list, such as [1, "a"]')
    if not isinstance(kwargs, dict):
        raise _bad("kwargs", kwargs, 'a JSON object, such as {"to": "ops"}')
    size = len(json.dumps([args, kwargs]).encode())
    if size > MAX_ARGUMENTS_BYTES:
        raise ConfigurationError(
            f"args and kwargs: {size} bytes as JSON, at most {MAX_ARGUMENTS_BYTES}: pass an id "
            "the task looks the rest up by"
        )
    return args, kwargs


def send_options(given: Mapping[str, Any]) -> dict[str, Any]:
    """The send options Celery takes, checked (``None``: not set)."""
    unknown = sorted(set(given) - set(SEND_OPTIONS))
    if unknown:
        raise ConfigurationError(f"unknown send option(s) {unknown}: one of {list(SEND_OPTIONS)}")
    found = {name: value for name, value in given.items() if value is not None}
    for name in ("queue", "exchange", "routing_key"):
        if name in found and not (isinstance(found[name], str) and found[name]):
            raise _bad(name, found[name], "a name")
    priority = found.get("priority")
    if priority is not None and (
        isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 255
    ):
        raise _bad("priority", priority, "an int from 0 to 255")
    expires = found.get("expires")
    if expires is not None and (
        isinstance(expires, bool) or not isinstance(expires, (int, float)) or expires <= 0
    ):
        raise _bad("expires", expires, "a number of seconds > 0")
    headers = found.get("headers")
    if headers is not None and not isinstance(_json("headers", headers), dict):
        raise _bad("headers", headers, "a JSON object")
    return found


def pglock_options(given: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The library's per-entry options (``catch_up``, ``catch_up_limit``, ``overdue_after``)."""
    unknown = sorted(set(given) - set(PGLOCK_OPTIONS))
    if unknown:
        raise ConfigurationError(f"unknown option(s) {unknown}: one of {list(PGLOCK_OPTIONS)}")
    found = {key: value for key, value in given.items() if value is not None}
    where = f"entry {name!r}"
    if "catch_up" in found or "catch_up_limit" in found:
        catch_up_option(found.get("catch_up", "none"), found.get("catch_up_limit", 1), where)
    overdue_option(found.get("overdue_after"), where)
    return found


def entry_name(name: Any) -> str:
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME_LENGTH:
        raise _bad("name", name, f"a name of 1 to {MAX_NAME_LENGTH} characters")
    return name


def _cron_text(cron: Any) -> str:
    fields = str(cron).split()
    if len(fields) != 5:
        raise _bad("cron", cron, "five fields: minute hour day-of-month month day-of-week")
    minute, hour, day_of_month, month_of_year, day_of_week = fields
    try:
        crontab(minute, hour, day_of_week, day_of_month, month_of_year)
    except (ValueError, TypeError) as exc:
        raise _bad("cron", cron, f"a cron expression Celery reads ({exc})") from None
    return " ".join(fields)


def _solar_spec(event: Any, lat: Any, lon: Any) -> dict[str, Any]:
    try:
        solar(cast(Any, str(event)), float(lat), float(lon))
    except (ValueError, TypeError) as exc:
        raise _bad("solar", event, f"a solar event at a latitude and longitude ({exc})") from None
    return {"solar": str(event), "lat": float(lat), "lon": float(lon)}


def _json(field: str, value: Any) -> Any:
    """``value`` as JSON: parsed when given as text, checked to encode as JSON else."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as exc:
            raise _bad(field, value, f"JSON ({exc})") from None
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise _bad(field, value, f"JSON ({exc})") from None
    return value


def _bad(field: str, value: Any, wanted: str) -> ConfigurationError:
    return ConfigurationError(f"{field}: {value!r} is not {wanted}")
