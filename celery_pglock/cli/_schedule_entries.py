"""``celery -A proj pglock entries …``: schedule entries stored in PostgreSQL, changed
at runtime (``celery_pglock.schedules``, which each command calls).

``add`` and ``edit`` take the same options; ``edit`` changes only those given. ``export``
writes every entry as JSON that ``import --from file`` takes back; ``import`` also copies
the app's ``beat_schedule``, django-celery-beat's tables or RedBeat's keys
(``_entry_imports``; ``--dry-run`` first: every entry listed with what it becomes, or why
it cannot be carried over).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import click
from celery import Celery

from celery_pglock import _entry_imports as imports
from celery_pglock import schedules
from celery_pglock.cli import _output as output
from celery_pglock.cli._common import current_app, json_option, reported_errors
from celery_pglock.cli._entries import BY_HELP
from celery_pglock.errors import ConfigurationError

F = TypeVar("F", bound=Callable[..., Any])
SOURCES = ["config", "django", "redbeat", "file"]
JSON_HELP = "JSON, e.g. '[1, \"a\"]'"


def _entry_options(function: F) -> F:
    """The options ``add`` and ``edit`` share: what an entry is made of."""
    options = [
        click.option("--every", help="An interval: 30s, 5m, 2h, 1d (or seconds)."),
        click.option("--cron", help='A cron expression: "*/5 * * * *".'),
        click.option("--tz", help="The cron expression's timezone [the app's timezone]."),
        click.option("--at", help="Once, at this time: 2026-12-24T09:00:00Z."),
        click.option("--args", help=f"Positional arguments: {JSON_HELP}."),
        click.option("--kwargs", help='Keyword arguments: JSON, e.g. \'{"to": "ops"}\'.'),
        click.option("--queue"),
        click.option("--routing-key"),
        click.option("--exchange"),
        click.option("--priority", type=click.IntRange(0, 255)),
        click.option("--expires", type=float, help="Seconds a sent message stays valid."),
        click.option("--catch-up", type=click.Choice(["none", "latest", "all"])),
        click.option("--overdue-after", type=float, help="Seconds: alert when overdue."),
        click.option("--enabled/--disabled", default=None, help="Send it, or keep it stored only."),
        click.option("--force", is_flag=True, help="A task only the workers import."),
        click.option("--by", help=BY_HELP),
        json_option,
    ]
    for option in reversed(options):
        function = option(function)
    return function


def _given(values: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in values.items() if value is not None}


@click.group()
def entries() -> None:
    """Schedule entries stored in PostgreSQL: changed at runtime, no redeploy."""


@entries.command()
@click.argument("name")
@click.option("--task", required=True, help="The task the entry sends.")
@_entry_options
@click.pass_context
def add(ctx: click.Context, /, name: str, task: str, **values: Any) -> None:
    """Store a new entry NAME; every beat replica sends it from its next tick."""
    app, as_json, by, force = _common(ctx, values)
    with reported_errors():
        made = schedules.add(app, name, task, by=by, force=force, **_given(values))
    _report("added", made, as_json)


@entries.command()
@click.argument("name")
@click.option("--task", help="The task the entry sends.")
@_entry_options
@click.pass_context
def edit(ctx: click.Context, /, name: str, task: str | None, **values: Any) -> None:
    """Change entry NAME: only the options given change."""
    app, as_json, by, force = _common(ctx, values)
    with reported_errors():
        made = schedules.update(app, name, by=by, force=force, **_given({**values, "task": task}))
    _report("changed", made, as_json)


@entries.command()
@click.argument("name")
@click.option("--by", help=BY_HELP)
@json_option
@click.pass_context
def rm(ctx: click.Context, name: str, by: str | None, as_json: bool) -> None:
    """Remove entry NAME: beat sends nothing more of it."""
    app = current_app(ctx)
    with reported_errors():
        removed = schedules.remove(app, name, by=by)
    _report("removed", removed, as_json)


@entries.command(name="list")
@json_option
@click.pass_context
def list_(ctx: click.Context, as_json: bool) -> None:
    """Every stored entry, by name."""
    app = current_app(ctx)
    with reported_errors():
        found = schedules.entries(app)
    if as_json:
        output.echo_json([entry.as_json() for entry in found])
        return
    rows = [(e.name, e.task, _schedule_text(e.schedule), _state(e), e.changed_by) for e in found]
    click.echo(output.table(["NAME", "TASK", "SCHEDULE", "STATE", "CHANGED BY"], rows))


@entries.command()
@click.argument("path", type=click.File("w"), default="-")
@click.pass_context
def export(ctx: click.Context, path: Any) -> None:
    """Every stored entry as JSON, to PATH (default: standard output), for ``import``."""
    app = current_app(ctx)
    with reported_errors():
        found = schedules.entries(app)
    json.dump([_portable(entry) for entry in found], path, indent=2)
    path.write("\n")


@entries.command(name="import")
@click.option(
    "--from", "source", required=True, type=click.Choice(SOURCES),
    help="config: the app's beat_schedule; django: django-celery-beat's tables; redbeat: "
    "RedBeat's keys in Redis; file: what `entries export` wrote.",
)  # fmt: skip
@click.argument("where", required=False)
@click.option("--dry-run", is_flag=True, help="List what each entry becomes; store nothing.")
@click.option("--force", is_flag=True, help="Tasks only the workers import.")
@click.option("--by", help=BY_HELP)
@click.pass_context
def import_(
    ctx: click.Context, /, source: str, where: str | None, dry_run: bool, **who: Any
) -> None:
    """Copy entries into the store, each listed with what it became (or why not).

    WHERE: the file (``--from file``), the Django database's DSN (``--from django``,
    default pglock_dsn), RedBeat's Redis URL (``--from redbeat``, default
    redbeat_redis_url or the broker)."""
    app = current_app(ctx)
    failed = 0
    with reported_errors():  # an outage half-way: said in one line, the exit code its
        found = _read(app, source, where)
        for name, spec, unreadable in found:
            problem = unreadable or _import_one(app, name, spec, dry_run=dry_run, **who)
            failed += problem is not None
            outcome = f"NOT CARRIED OVER: {problem}" if problem else _spec_text(spec)
            click.echo(f"{name}: {outcome}")
    verb = "would be stored" if dry_run else "stored"
    click.echo(f"\n{len(found) - failed} of {len(found)} entries {verb}", err=True)
    if failed:
        raise click.exceptions.Exit(1)


def _read(app: Celery, source: str, where: str | None) -> list[imports.Imported]:
    if source == "config":
        return imports.from_config(app)
    if source == "django":
        return imports.from_django(app, where)
    if source == "redbeat":
        return imports.from_redbeat(app, where)
    if where is None:
        raise click.UsageError("--from file needs the file `entries export` wrote")
    with open(where, encoding="utf-8") as exported:
        return imports.from_export(json.load(exported))


def _import_one(
    app: Celery, name: str, spec: dict[str, Any], *, dry_run: bool, force: bool, by: str | None
) -> str | None:
    """Store (or, ``dry_run``, check) one imported entry; why not, or None."""
    given = dict(spec)
    task = given.pop("task")
    try:
        if dry_run:
            schedules.checked(app, name, {**given, "task": task}, force=force, now_given=True)
        else:
            schedules.ensure(app, name, task, by=by, force=force, **given)
    except ConfigurationError as exc:
        return str(exc)
    return None


def _portable(entry: schedules.Entry) -> dict[str, Any]:
    """An entry as ``import --from file`` takes it back: what ``add`` is given."""
    spec: dict[str, Any] = {"name": entry.name, "task": entry.task, **entry.schedule}
    spec |= {"args": entry.args, "kwargs": entry.kwargs, **entry.options, **entry.pglock}
    spec |= {"enabled": entry.enabled}
    for key in ("starts_at", "ends_at"):
        value = getattr(entry, key)
        if value is not None:
            spec[key] = value.isoformat()
    return spec


def _common(ctx: click.Context, values: dict[str, Any]) -> tuple[Celery, bool, str | None, bool]:
    return current_app(ctx), values.pop("as_json"), values.pop("by"), values.pop("force")


def _report(done: str, entry: schedules.Entry, as_json: bool) -> None:
    if as_json:
        output.echo_json(entry.as_json())
        return
    click.echo(f"{done} {entry.name}: {entry.task} {_schedule_text(entry.schedule)}")


def _schedule_text(stored: dict[str, Any]) -> str:
    if "every" in stored:
        return f"every {output.duration(stored['every'])}"
    if "cron" in stored:
        return f"cron {stored['cron']}" + (f" ({stored['tz']})" if stored.get("tz") else "")
    if "at" in stored:
        return f"once at {stored['at']}"
    return f"{stored['solar']} at {stored['lat']}, {stored['lon']}"


def _spec_text(spec: dict[str, Any]) -> str:
    schedule_keys = ("every", "cron", "tz", "at", "solar", "lat", "lon")
    stored = {key: spec[key] for key in schedule_keys if key in spec}
    return f"{spec['task']} {_schedule_text(stored)}" if stored else str(spec["task"])


def _state(entry: schedules.Entry) -> str:
    return "enabled" if entry.enabled else "disabled"
