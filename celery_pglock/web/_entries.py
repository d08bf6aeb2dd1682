"""The dashboard's forms for schedule entries stored in PostgreSQL: add one, change one,
remove one, each through ``celery_pglock.schedules`` (checked, audited as ``web:<user>``
with its before and after). Reviewed first: the confirmation shows the entry's next five
slots, a DST switch's doubles and gaps flagged (``celery pglock schedule``'s preview)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from celery import Celery

from celery_pglock import _preview as preview
from celery_pglock import schedules
from celery_pglock._entry_specs import celery_schedule
from celery_pglock.errors import ConfigurationError

NEXT_SLOTS = 5
# What the form sends, as ``schedules`` takes it (an empty field: not given).
FORM_FIELDS = ("task", "every", "cron", "tz", "at", "args", "kwargs", "queue")


def given(fields: dict[str, str]) -> dict[str, Any]:
    """The entry the form describes: its non-empty fields, and the enabled box."""
    found: dict[str, Any] = {key: fields[key] for key in FORM_FIELDS if fields.get(key)}
    found["enabled"] = fields.get("enabled") == "on"
    return found


def review(app: Celery, kind: str, fields: dict[str, str]) -> dict[str, Any]:
    """What the change would store, and the next slots it would send; nothing stored."""
    name = _name(fields)
    before = schedules.get(app, name)
    if kind == "entry_remove":
        if before is None:
            raise ConfigurationError(f"no entry {name!r} is stored")
        return {"before": before.as_json(), "upcoming": []}
    wanted = given(fields)
    if kind == "entry_edit":
        if before is None:
            raise ConfigurationError(f"no entry {name!r} is stored: add it first")
        wanted = schedules.merged(before, wanted)
    values = schedules.checked(app, name, wanted, force=_force(fields), now_given="at" in wanted)
    made = celery_schedule(values["schedule"], app)
    after = datetime.now(timezone.utc)
    upcoming = preview.upcoming(made, after, NEXT_SLOTS)
    return {"before": before.as_json() if before else None, "upcoming": upcoming}


def do(app: Celery, actor: str, kind: str, fields: dict[str, str]) -> dict[str, Any]:
    """Store the change as ``actor``; the entry as it is now (as it was, once removed)."""
    name = _name(fields)
    if kind == "entry_remove":
        return schedules.remove(app, name, by=actor).as_json()
    wanted = given(fields)
    task = wanted.pop("task", None)
    if kind == "entry_add":
        if not task:
            raise ConfigurationError("task: the name of the task the entry sends")
        return schedules.add(app, name, task, by=actor, force=_force(fields), **wanted).as_json()
    if task:
        wanted["task"] = task
    return schedules.update(app, name, by=actor, force=_force(fields), **wanted).as_json()


def outcome(kind: str, actor: str, done: dict[str, Any]) -> str:
    verb = {"entry_add": "added", "entry_edit": "changed", "entry_remove": "removed"}[kind]
    return f"entry {done['name']} {verb} by {actor}"


def _name(fields: dict[str, str]) -> str:
    if not fields.get("name"):
        raise ConfigurationError("the entry's name is required")
    return fields["name"]


def _force(fields: dict[str, str]) -> bool:
    return fields.get("force") == "on"
