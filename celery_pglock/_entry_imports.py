"""Other schedulers' entries as stored entries (``celery pglock entries import``): the
app's ``beat_schedule``, django-celery-beat's tables, RedBeat's keys in Redis, or what
``entries export`` wrote.

Each reader gives ``(name, what it becomes, why not)``: what ``schedules.add`` is given,
and, when something has no stored form (a schedule type, an option), that reason instead
of a guess. Nothing is dropped silently: what cannot be carried over is named.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

from celery import Celery
from celery.schedules import crontab, schedule, solar

from celery_pglock._config import app_settings
from celery_pglock._dsn import check_dsn, redact
from celery_pglock._entry_specs import PGLOCK_OPTIONS, SEND_OPTIONS
from celery_pglock.errors import ConfigurationError, StatementFailed
from celery_pglock.store.statements import opened

Imported = tuple[str, dict[str, Any], str | None]  # name, what it becomes, why not
CRON_FIELDS = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
PERIOD_SECONDS = {"days": 86400, "hours": 3600, "minutes": 60, "seconds": 1, "microseconds": 1e-6}
REDBEAT_PREFIX = "redbeat:"


def from_config(app: Celery) -> list[Imported]:
    """``beat_schedule``'s entries."""
    found: list[Imported] = []
    for name, raw in (app.conf.beat_schedule or {}).items():
        spec: dict[str, Any] = {"task": raw.get("task")}
        problem = _celery_schedule(raw.get("schedule"), spec)
        spec |= {"args": list(raw.get("args") or ()), "kwargs": dict(raw.get("kwargs") or {})}
        rest = {key: value for key, value in raw.items() if key not in {"task", "schedule"}}
        found.append((name, spec, problem or _options(rest, spec)))
    return found


def from_redbeat(app: Celery, url: str | None) -> list[Imported]:
    """RedBeat's entries: each key of its schedule, its JSON definition (no RedBeat code
    needed). ``url``: the Redis RedBeat uses (default: ``redbeat_redis_url``, else the
    broker's)."""
    try:
        import redis  # noqa: PLC0415 - only for this import
    except ImportError:
        raise ConfigurationError("--from redbeat reads Redis: pip install redis") from None
    where = url or app.conf.get("redbeat_redis_url") or app.conf.broker_url
    prefix = app.conf.get("redbeat_key_prefix") or REDBEAT_PREFIX
    try:
        client = redis.Redis.from_url(where)
        try:
            keys: list[Any] = list(client.zrange(prefix + ":schedule", 0, -1))  # key names
            definitions = [client.hget(key, "definition") for key in keys]
        finally:
            client.close()
    except (redis.RedisError, ValueError) as exc:
        raise ConfigurationError(
            f"cannot read RedBeat's entries from Redis ({redact(where)}): {redact(str(exc))}"
        ) from None
    return [_redbeat_entry(json.loads(raw)) for raw in definitions if raw]


def from_django(app: Celery, dsn: str | None) -> list[Imported]:
    """django-celery-beat's periodic tasks, read from its tables (``dsn``: the Django
    database, default the app's ``pglock_dsn``)."""
    settings = app_settings(app)
    if dsn:
        settings = dataclasses.replace(settings, dsn=check_dsn(dsn))
    with opened(settings) as statements:
        try:
            rows = statements.rows("import_django_entries")
        except StatementFailed as exc:
            raise ConfigurationError(
                f"no django-celery-beat tables to read ({exc}): give the Django database's "
                "DSN, with ?options=-csearch_path%3Dschema if they live in another schema"
            ) from None
    return [_django_entry(row) for row in rows]


def from_export(data: Iterable[Mapping[str, Any]]) -> list[Imported]:
    """What ``entries export`` wrote."""
    found: list[Imported] = []
    for item in data:
        spec = dict(item)
        found.append((str(spec.pop("name")), spec, None))
    return found


def _celery_schedule(given: Any, spec: dict[str, Any]) -> str | None:
    if isinstance(given, (int, float, timedelta)):
        given = schedule(given)
    if isinstance(given, crontab):
        written: Any = given  # Celery keeps each field as written (``_orig_*``)
        spec["cron"] = " ".join(str(getattr(written, f"_orig_{f}")) for f in CRON_FIELDS)
        return None
    if isinstance(given, solar):
        spec |= {"solar": given.event, "lat": given.lat, "lon": given.lon}
        return None
    if isinstance(given, schedule):
        spec["every"] = given.seconds
        return None
    return f"schedule {given!r} has no stored form (interval, crontab, solar or a time)"


def _options(raw: Mapping[str, Any], spec: dict[str, Any]) -> str | None:
    """The send options of an entry (its ``options``, or beside them) into ``spec``, and
    the library's per-entry ones (``pglock_catch_up``…) as the stored entry names them."""
    options = dict(raw.get("options") or {})
    options |= {key: raw[key] for key in SEND_OPTIONS if key in raw}
    for key in SEND_OPTIONS:
        if options.get(key) is not None:
            spec[key] = options.pop(key)
    for field, option in PGLOCK_OPTIONS.items():
        if option in options:
            spec[field] = options.pop(option)
    left = sorted(set(options) | (set(raw) - {"args", "kwargs", "options", *SEND_OPTIONS}))
    if "enabled" in left:
        spec["enabled"] = bool(raw.get("enabled"))
        left.remove("enabled")
    return f"option(s) {left} have no stored form" if left else None


def _redbeat_entry(definition: dict[str, Any]) -> Imported:
    name = str(definition.get("name"))
    spec: dict[str, Any] = {"task": definition.get("task")}
    spec |= {"args": list(definition.get("args") or ()), "kwargs": definition.get("kwargs") or {}}
    problem = _redbeat_schedule(definition.get("schedule") or {}, spec)
    rest = {"options": definition.get("options") or {}, "enabled": definition.get("enabled", True)}
    return name, spec, problem or _options(rest, spec)


def _redbeat_schedule(given: Mapping[str, Any], spec: dict[str, Any]) -> str | None:
    kind = given.get("__type__")
    if kind == "interval" and not given.get("relative"):
        spec["every"] = float(given["every"])
        return None
    if kind == "crontab":
        spec["cron"] = " ".join(str(given[f]) for f in CRON_FIELDS)
        return None
    return f"RedBeat schedule {dict(given)!r} has no stored form (an interval or a crontab)"


def _django_entry(row: Mapping[str, Any]) -> Imported:
    spec: dict[str, Any] = {"task": row["task"]}
    problem = _django_schedule(row, spec)
    try:
        spec |= {
            "args": json.loads(row["args"] or "[]"),
            "kwargs": json.loads(row["kwargs"] or "{}"),
        }
        headers = json.loads(row["headers"] or "{}")
    except ValueError as exc:
        return row["name"], spec, f"its args, kwargs or headers are not JSON: {exc}"
    for key in ("queue", "exchange", "routing_key", "priority"):
        if row[key] not in (None, ""):
            spec[key] = row[key]
    if headers:
        spec["headers"] = headers
    if row["start_time"] is not None:
        spec["starts_at"] = row["start_time"]
    if row["expires"] is not None:
        spec["ends_at"] = row["expires"]
    spec["enabled"] = bool(row["enabled"])
    left = [name for name in ("expire_seconds", "one_off") if row[name]]
    if left and problem is None and not (left == ["one_off"] and "at" in spec):
        problem = f"option(s) {left} have no stored form"
    return row["name"], spec, problem


def _django_schedule(row: Mapping[str, Any], spec: dict[str, Any]) -> str | None:
    if row["interval_every"] is not None:
        spec["every"] = row["interval_every"] * PERIOD_SECONDS[row["interval_period"]]
        return None
    if row["minute"] is not None:
        spec["cron"] = " ".join(str(row[f]) for f in CRON_FIELDS)
        if row["cron_timezone"] not in (None, ""):
            spec["tz"] = str(row["cron_timezone"])
        return None
    if row["solar_event"] is not None:
        spec |= {"solar": row["solar_event"], "lat": float(row["latitude"])}
        spec["lon"] = float(row["longitude"])
        return None
    if row["clocked_time"] is not None:
        at: datetime = row["clocked_time"]
        spec["at"] = at.astimezone(timezone.utc).isoformat()
        return None
    return "it has no schedule"
